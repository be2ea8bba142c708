"""The local store: versions on disk, temp files and the segment files that hold small versions."""
