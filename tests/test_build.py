"""What the package reports about its build matches the torch it runs with."""
import torch

import kvcache_ext


def test_build_info_matches_runtime():
    info = kvcache_ext.build_info()
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert info["cuda"] == bool(info["cuda_archs"])
    if info["cuda"]:
        assert torch.version.cuda is not None
        assert info["cuda_version"].split(".")[0] == torch.version.cuda.split(".")[0]
        assert all(a >= 800 for a in info["cuda_archs"])
