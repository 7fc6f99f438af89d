"""Write the `make e2e` copy of ray_configs/cluster.yaml: one head node on loopback.

    python scripts/e2e/render_config.py ray_configs/cluster.yaml OUT.yaml \
        --ssh-user root --ssh-key KEY [--cluster-name NAME]

Only where the cluster is and how to log in change (cluster_name, provider's
head_ip and worker_ips, auth); file_mounts, setup and start commands are the
shipped ones, so `make e2e` tests the file operators use.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

LOOPBACK = "127.0.0.1"


def loopback_config(config: dict[str, Any], *, ssh_user: str, ssh_key: str,
                    cluster_name: str) -> dict[str, Any]:
    """``config`` pointed at a single head node on 127.0.0.1; raises if it is not a local-provider config."""
    provider = config.get("provider", {})
    if provider.get("type") != "local":
        raise ValueError(f"expected a local-provider config, got provider.type={provider.get('type')!r}")
    out = dict(config)
    out["cluster_name"] = cluster_name
    out["provider"] = {**provider, "head_ip": LOOPBACK, "worker_ips": []}
    out["auth"] = {"ssh_user": ssh_user, "ssh_private_key": ssh_key}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--ssh-user", required=True)
    parser.add_argument("--ssh-key", required=True)
    parser.add_argument("--cluster-name", default="flotilla-e2e")
    args = parser.parse_args()
    config = yaml.safe_load(args.source.read_text())
    rendered = loopback_config(config, ssh_user=args.ssh_user, ssh_key=args.ssh_key,
                               cluster_name=args.cluster_name)
    args.out.write_text(yaml.safe_dump(rendered, sort_keys=False))


if __name__ == "__main__":
    main()
