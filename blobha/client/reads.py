"""The reads of :class:`~blobha.client.facade.Client` beyond one download: whether a key
exists, its metadata, and listings with metadata. Functions of the router the facade delegates
to."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from blobha.client.routing import Router
from blobha.client.values import BlobMeta
from blobha.core.errors import KeyNotFound
from blobha.core.keys import validate_key
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.convert import meta_from_pb

#: Metadata calls a detailed listing keeps in flight at once: enough to hide the round trips,
#: few enough not to crowd out other callers' calls at the masters.
LIST_PARALLELISM = 8


def meta(router: Router, key: str) -> BlobMeta:
    validate_key(key)
    return meta_from_pb(router.read_meta(key, None))


def exists(router: Router, key: str) -> bool:
    """Whether ``key`` has a committed version (a user with no permission on it is refused,
    as for its metadata)."""
    try:
        meta(router, key)
    except KeyNotFound:
        return False
    return True


def list_keys(router: Router, prefix: str, page_size: int) -> Iterator[list[str]]:
    """The keys starting with ``prefix``, a page at a time."""
    token = ""
    while True:
        request = pb.ListRequest(prefix=prefix, page_token=token, page_size=page_size)
        page = router.read_call("list keys", "List", request)
        yield list(page.keys)
        token = page.next_page_token
        if not token:
            return


def list_detail(router: Router, prefix: str, page_size: int) -> Iterator[BlobMeta]:
    """The metadata of every key starting with ``prefix``, in listing order; a key deleted
    between its listing and its metadata is left out."""
    pool = ThreadPoolExecutor(LIST_PARALLELISM, thread_name_prefix="blobha-list")
    try:
        for keys in list_keys(router, prefix, page_size):
            for found in pool.map(lambda k: _meta_or_none(router, k), keys):
                if found is not None:
                    yield found
    finally:
        # A caller that stops early does not wait for the rest of the page's calls.
        pool.shutdown(wait=False, cancel_futures=True)


def _meta_or_none(router: Router, key: str) -> BlobMeta | None:
    try:
        return meta(router, key)
    except KeyNotFound:
        return None
