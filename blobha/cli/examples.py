"""One example per command, for the end of its ``--help`` (the global options and the exit
codes are in ``blobha --help`` only, once)."""

from __future__ import annotations

EXAMPLES: dict[str, str] = {
    "create": "blobha create model.bin -f model.bin -a u:alice:rwa,o::r -r 3",
    "put": "tar czf - conf/ | blobha put conf.tgz --wait-replication 2",
    "update": "echo v2 | blobha update dictionary",
    "cat": "blobha cat model.bin -f /tmp/model.bin",
    "fetch": "blobha fetch conf.tgz --uncompress",
    "delete": "blobha delete old-model.bin old-conf.tgz",
    "list": "blobha list -l --prefix model --json",
    "meta": "blobha meta model.bin --json",
    "set-acl": "blobha set-acl model.bin -s u:alice:rwa,u:bob:r",
    "replication": "blobha replication --update -r 3 model.bin",
    "wait-replication": "blobha wait-replication model.bin conf.tgz --min 2 --timeout 120",
    "cluster": "blobha cluster --json",
    "health": "blobha health 127.0.0.1:6627",
    "serve": "blobha serve --config /etc/blobha/master.toml",
    "local-cluster": "blobha local-cluster --nodes 3 --data-dir ./blobha-local",
    "token": "blobha token job model.bin conf.tgz --lifetime 3600 --json",
    "spark-submit": ("blobha spark-submit --blob model.bin --min-replication 2 --"
                     " --master yarn job.py"),
    "bench": "blobha bench --local --metrics upload_mbps,download_mbps",
    "completion": "blobha completion bash > ~/.local/share/bash-completion/completions/blobha",
}


def epilog(command: str) -> str:
    example = EXAMPLES.get(command, "")
    lines = [f"example:\n  {example}\n"] if example else []
    lines.append("global options (--cluster, --user, --timeout, --json, ...) and exit codes:"
                 " blobha --help")
    return "\n".join(lines)
