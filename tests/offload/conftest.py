import pytest

from offload_helpers import offloaded


@pytest.fixture
def make_offloaded(tmp_path):
    """`make_offloaded(arch, **config)`: a fresh tiny model offloaded to its own store under
    `tmp_path` (folder `name`, default a new one per call); every offload is closed at teardown."""
    made = []

    def make(arch, name=None, **config):
        folder = tmp_path / (name or f"store{len(made)}")
        model, offload = offloaded(arch, folder, **config)
        made.append(offload)
        return model, offload

    yield make
    for offload in made:
        offload.close()
