"""``blobha://KEY`` for fsspec, and through it pandas, pyarrow and dask (needs ``fsspec``:
``pip install 'blobha[fsspec]'``). Registered as the ``blobha`` protocol through the
``fsspec.specs`` entry point, so ``fsspec.open("blobha://k")`` needs no import of this."""

from blobha.fs.filesystem import BlobhaFile, BlobhaFileSystem

__all__ = ["BlobhaFile", "BlobhaFileSystem"]
