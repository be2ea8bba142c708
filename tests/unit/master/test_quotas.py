"""Per-user quotas: what each check refuses, and whom it exempts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from blobha.core.acl import parse_acl
from blobha.core.blobstate import BlobState
from blobha.core.errors import ResourceExhausted
from blobha.master.quotas import QuotaLimits, Quotas
from blobha.master.rules import Authority
from blobha.sync import Usage, acl_bytes

LIMITS = QuotaLimits(keys=3, bytes=1000, acl_bytes=40, upload_bytes=500, job_tokens=2)


def _quotas(usage: dict[str, Usage], limits: QuotaLimits = LIMITS,
            seen: dict[str, tuple[float, int]] | None = None) -> Quotas:
    versions = seen if seen is not None else {}
    return Quotas(limits, Authority(frozenset({"root"}), "blobha"),
                  lambda user: usage.get(user, Usage()), versions.get, lambda: 0)


def _state(creator: str = "bob", size: int = 10, acl: str = "", created_at: float = 1.0
           ) -> BlobState:
    return BlobState(seq=1, size=size, digest="0" * 32, acl=tuple(parse_acl(acl)) if acl else (),
                     replication_factor=3, creator=creator, created_at=created_at,
                     updated_at=created_at, epoch=1, acked=True)


def _refused(option: str, call: object, *args: object) -> str:
    assert callable(call)
    with pytest.raises(ResourceExhausted) as e:
        call(*args)
    message = str(e.value)
    assert option in message and "\n" not in message, message
    return message


def test_a_create_past_the_key_quota_is_refused_with_the_figures_and_the_fix() -> None:
    q = _quotas({"bob": Usage(keys=3, bytes=30)})
    message = _refused("blobstore.quota.user.keys", q.check_write, "bob", None, _state(),
                       acl_bytes)
    assert "'bob'" in message and "holds 3" in message and "delete keys" in message
    q.check_write("alice", None, _state(creator="alice"), acl_bytes)  # her own count
    # An update adds no key.
    q.check_write("bob", _state(size=10), _state(size=10), acl_bytes)


def test_bytes_count_a_write_s_growth_against_the_key_s_creator() -> None:
    q = _quotas({"bob": Usage(keys=1, bytes=900)})
    q.check_write("bob", None, _state(size=100), acl_bytes)  # 1000: at the limit, not past
    _refused("blobstore.quota.user.bytes", q.check_write, "bob", None, _state(size=101),
             acl_bytes)
    # alice writing bob's key is charged to bob, the creator.
    _refused("blobstore.quota.user.bytes", q.check_write, "alice", _state(size=100),
             _state(size=201), acl_bytes)
    q.check_write("alice", _state(size=500), _state(size=50), acl_bytes)  # shrinking


def test_acl_bytes_are_counted_at_create_and_at_every_acl_change() -> None:
    q = _quotas({"bob": Usage(keys=1, acl_bytes=30)})
    _refused("blobstore.quota.user.acl.bytes", q.check_write, "bob", None,
             _state(acl="u:carol:r"), acl_bytes)  # 11 bytes: 41
    q.check_write("bob", None, _state(acl="u:cy:r"), acl_bytes)  # 8: 38
    _refused("blobstore.quota.user.acl.bytes", q.check_acl, "bob", "bob", 5, 16)
    q.check_acl("bob", "bob", 16, 5)  # smaller is always fine


def test_upload_bytes_and_a_said_size_are_refused_before_the_bytes_come() -> None:
    q = _quotas({"bob": Usage(keys=1, bytes=900)})
    _refused("blobstore.quota.user.upload.bytes", q.check_upload, "bob", 400, 101)
    q.check_upload("bob", 400, 100)
    q.check_upload("bob", 600, 0)  # a rewrite of bytes held adds none
    _refused("blobstore.quota.user.upload.bytes", q.check_begin, "bob", "bob", 0, 501, 0)
    _refused("blobstore.quota.user.bytes", q.check_begin, "bob", "bob", 0, 101, 0)
    q.check_begin("bob", "bob", 0, 150, 50)  # an update replacing 50 bytes grows by 100
    q.check_begin("bob", "bob", 0, -1, 0)  # no size said: counted as the bytes arrive


def test_job_tokens_past_the_quota_are_refused() -> None:
    q = _quotas({})
    q.check_job_token("bob", 1)
    _refused("auth.job.token.max.per.user", q.check_job_token, "bob", 2)


def test_admins_and_the_masters_are_exempt_and_zero_means_no_limit() -> None:
    full = Usage(keys=10**6, bytes=10**12, acl_bytes=10**9)
    q = _quotas({"root": full, "blobha": full, "bob": full})
    for user in ("root", "blobha"):
        q.check_write(user, None, _state(creator=user, size=10**6, acl="u:x:r"), acl_bytes)
        q.check_upload(user, 10**9, 10**9)
        q.check_job_token(user, 10**6)
    # An admin writing bob's key is not held to bob's quota either.
    q.check_write("root", _state(), _state(size=10**9), acl_bytes)
    unlimited = _quotas({"bob": full}, QuotaLimits())
    unlimited.check_write("bob", None, _state(size=10**9, acl="u:x:r"), acl_bytes)
    unlimited.check_upload("bob", 10**12, 10**12)
    unlimited.check_job_token("bob", 10**6)
    unlimited.check_begin("bob", "bob", 10**12, 10**12, 0)
    # One limit at zero leaves the others in force.
    keys_only = _quotas({"bob": replace(full, keys=3)}, QuotaLimits(keys=3))
    keys_only.check_write("bob", _state(), _state(size=10**9), acl_bytes)
    _refused("blobstore.quota.user.keys", keys_only.check_write, "bob", None, _state(),
             acl_bytes)


def test_a_commit_counts_until_the_view_shows_it_so_sequential_writes_are_held_exactly() -> None:
    view: dict[str, Usage] = {"bob": Usage(keys=2, bytes=100)}
    seen: dict[str, tuple[float, int]] = {}
    q = _quotas(view, seen=seen)
    new = _state(size=300)
    q.check_write("bob", None, new, acl_bytes)
    q.committed(None, new, "k3", acl_bytes)  # the view has not heard of it yet
    _refused("blobstore.quota.user.keys", q.check_write, "bob", None, _state(), acl_bytes)
    # An update of it, also unseen: its growth adds to the create's.
    bigger = replace(new, seq=2, size=800)
    q.committed(new, bigger, "k3", acl_bytes)
    _refused("blobstore.quota.user.bytes", q.check_write, "bob", _state(size=0),
             _state(size=101), acl_bytes)
    # The view has the create alone: the update still counts.
    view["bob"] = Usage(keys=3, bytes=400)
    seen["k3"] = (1.0, 1)
    _refused("blobstore.quota.user.bytes", q.check_write, "bob", _state(size=0),
             _state(size=101), acl_bytes)
    # Once the view has the last version, it is counted there alone.
    view["bob"] = Usage(keys=3, bytes=900)
    seen["k3"] = (1.0, 2)
    q.check_write("bob", _state(size=0), _state(size=100), acl_bytes)
    view["bob"] = Usage(keys=2, bytes=100)  # deleted since: nothing of it left here
    del seen["k3"]
    q.check_write("bob", None, _state(), acl_bytes)


def test_a_delete_frees_its_room_at_once_and_a_new_incarnation_is_told_from_the_old() -> None:
    view: dict[str, Usage] = {"bob": Usage(keys=3, bytes=300)}
    seen: dict[str, tuple[float, int]] = {"k": (1.0, 1)}
    q = _quotas(view, seen=seen)
    _refused("blobstore.quota.user.keys", q.check_write, "bob", None, _state(), acl_bytes)
    q.deleted(_state(size=100), "k", acl_bytes)
    q.check_write("bob", None, _state(), acl_bytes)  # the view still has it; not counted
    # Created again at once, at version 1 again: it counts, whatever the view has.
    again = _state(size=100, created_at=2.0)
    q.committed(None, again, "k", acl_bytes)
    _refused("blobstore.quota.user.keys", q.check_write, "bob", None, _state(), acl_bytes)
    view["bob"] = Usage(keys=2, bytes=200)  # the view has heard of the delete alone
    del seen["k"]
    _refused("blobstore.quota.user.keys", q.check_write, "bob", None, _state(), acl_bytes)
    view["bob"] = Usage(keys=3, bytes=300)  # and of the new incarnation: counted there
    seen["k"] = (2.0, 1)
    _refused("blobstore.quota.user.keys", q.check_write, "bob", None, _state(), acl_bytes)
    view["bob"] = Usage(keys=2, bytes=200)  # deleted by another leader: nothing left here
    del seen["k"]
    q.check_write("bob", None, _state(), acl_bytes)


def test_the_clusters_key_limit_refuses_every_creator_admins_too() -> None:
    count = [5]
    q = Quotas(QuotaLimits(cluster_keys=5), Authority(frozenset({"root"}), "blobha"),
               lambda user: Usage(), {}.get, lambda: count[0])
    for user in ("bob", "root"):
        message = _refused("blobstore.keys.max", q.check_write, user, None,
                           _state(creator=user), acl_bytes)
        assert "holds 5" in message and "delete keys" in message
    q.check_write("bob", _state(), _state(), acl_bytes)  # an update adds no key
    count[0] = 4
    q.check_write("bob", None, _state(), acl_bytes)


def test_a_create_counts_against_the_clusters_limit_before_the_view_shows_it() -> None:
    count = [4]
    seen: dict[str, tuple[float, int]] = {}
    q = Quotas(QuotaLimits(cluster_keys=5), Authority(frozenset({"root"}), "blobha"),
               lambda user: Usage(), seen.get, lambda: count[0])
    q.check_write("bob", None, _state(), acl_bytes)
    q.committed(None, _state(), "k5", acl_bytes)  # the view still shows 4 keys
    _refused("blobstore.keys.max", q.check_write, "alice", None, _state(creator="alice"),
             acl_bytes)
    seen["k5"], count[0] = (1.0, 1), 5  # the view has it now: counted once, not twice
    message = _refused("blobstore.keys.max", q.check_write, "alice", None,
                       _state(creator="alice"), acl_bytes)
    assert "holds 5" in message
