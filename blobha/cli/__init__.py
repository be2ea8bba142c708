"""The ``blobha`` command line, shaped after ``storm blobstore``.

Global options go before or after the command: ``--cluster HOST:PORT[,HOST:PORT...]``
(default ``$BLOBHA_CLUSTER``, else 127.0.0.1:6627) and ``--user NAME`` (default
``$BLOBHA_USER``, else the operating-system user).

Errors are one line on stderr, ``blobha: error: <message>``, and the exit status says which
kind of error it was:

====  =========================================================================
code  meaning
====  =========================================================================
0     success
1     other error, including a local file that cannot be read or written
2     usage error (bad command line)
3     the key does not exist
4     the key already exists
5     not authorized (the ACL does not allow it)
6     invalid argument (bad key, ACL, number...)
7     not the leader (no leader could be reached for a write)
8     version conflict (the blob changed meanwhile)
9     checksum mismatch (corrupt data detected)
10    resource exhausted (no disk space on the masters, message too large)
11    unavailable (no master or no leader reachable before the timeout)
12    deadline exceeded (also: wait-replication did not reach its minimum)
13    upload lost (it expired, or the leader changed and it could not restart)
14    internal error
15    not authenticated (no or a wrong token or client certificate)
16    TLS settings that every master's certificate proves wrong (--ca names another CA,
      the certificate does not name the address, or TLS on one side only)
17    busy (until the timeout, the masters refused the call: every call thread in use)
130   interrupted (Ctrl-C)
141   broken pipe (the reader of stdout went away, e.g. ``blobha cat k | head``)
143   terminated (SIGTERM); ``cat -f`` removes its partial file first
====  =========================================================================
"""

from __future__ import annotations

from blobha.cli.app import Terminated, main
from blobha.cli.blobs import format_meta
from blobha.cli.cluster import format_cluster
from blobha.cli.connect import DEFAULT_CLUSTER, ClientFactory
from blobha.cli.output import (
    EXIT_BROKEN_PIPE,
    EXIT_CODES_EPILOG,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    PROG,
)
from blobha.cli.parser import DEFAULT_BASE_PORT, build_parser
from blobha.cli.progress import Progress

# The client factory that tests replace is blobha.cli.connect.client_factory: replace it there
# (a name re-exported here would be a copy that no command reads).
__all__ = [
    "DEFAULT_BASE_PORT",
    "DEFAULT_CLUSTER",
    "EXIT_BROKEN_PIPE",
    "EXIT_CODES_EPILOG",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "PROG",
    "ClientFactory",
    "Progress",
    "Terminated",
    "build_parser",
    "format_cluster",
    "format_meta",
    "main",
]
