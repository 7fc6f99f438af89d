"""Two Ray nodes on one machine: STRICT_SPREAD puts the two TP shards on different nodes.

A module of its own: it starts a ``ray.cluster_utils.Cluster`` (a head and a
worker node, one CPU each, both on loopback) instead of the plain local
cluster of ``test_ray_executor.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.load.embedded import build_tokenizer
from actors.remote.ray_executor import RayExecutor
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import llama_config, write_checkpoint

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

PROMPTS = [[1, 17, 300, 4, 4, 99, 511, 256, 3], [1, 40, 41, 42], [5] * 20]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "num_kv_pages": 32, "dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def two_node_cluster(ray_stopped: None) -> Iterator[Cluster]:
    """Head + one worker node (1 CPU each) on 127.0.0.1, with this process connected (a cluster of its own:
    two nodes, not the session's shared one, which ``ray_stopped`` stops first)."""
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    with pytest.MonkeyPatch.context() as mp:
        # Cluster records its address as "the current cluster" in /tmp/ray; a
        # plain ray.init() elsewhere on this machine (another test run) would
        # then attach to it instead of starting its own. Keep it private.
        mp.setattr(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None)
        # ray.init(address=...) rewrites a loopback address to the machine's
        # outward IP, where nothing listens: these nodes serve loopback only.
        mp.setattr(ray._private.services, "resolve_ip_for_localhost", lambda host: host)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
        )
        try:
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
            ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
            cluster.wait_for_nodes()
        except BaseException:
            ray.shutdown()
            cluster.shutdown()
            raise
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old


def test_strict_spread_shards_on_two_nodes_match_one_rank(
    two_node_cluster: Cluster, tmp_path: Path
) -> None:
    folder = write_checkpoint(tmp_path / "llama", llama_config(), seed=0)
    build_tokenizer().save_pretrained(folder)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(str(folder), tensor_parallel_size=2, executor="ray", placement_strategy="STRICT_SPREAD", **ENGINE)
    try:
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor)
        nodes = [info.node_id for info in executor.shard_infos]
        # Ask the live actors too: the node ids are where they run now, not a stale report.
        assert [ray.get(s.ping.remote(), timeout=30).node_id for s in executor.shards] == nodes
        assert len(set(nodes)) == 2
        assert set(nodes) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == expected
    finally:
        llm.shutdown()
