"""What the package reports about its build matches the torch it runs with, and its link."""
import os
import runpy
import shutil
import subprocess
import sys

import pytest
import setuptools
import torch

import kvcache_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_build_info_matches_runtime():
    info = kvcache_ext.build_info()
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert info["cuda"] == bool(info["cuda_archs"])
    if info["cuda"]:
        assert torch.version.cuda is not None
        assert info["cuda_version"].split(".")[0] == torch.version.cuda.split(".")[0]
        assert all(a >= 800 for a in info["cuda_archs"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="an ELF shared object is Linux's")
def test_extension_links_the_shared_libstdcxx():
    """A private static libstdc++ in _C made every error message that formats an integer crash
    (SIGSEGV) instead of raising (the H100 build of 2026-11-26): _C must need libstdc++.so.6."""
    readelf = shutil.which("readelf")
    assert readelf, "readelf (binutils, which the build's g++ needs too) is not on PATH"
    dynamic = subprocess.run([readelf, "-d", kvcache_ext._C.__file__], capture_output=True, text=True,
                             check=True).stdout
    assert "[libstdc++.so.6]" in dynamic, dynamic


def fake_compiler(folder, prints):
    """A g++ stand-in that answers -print-file-name with ``prints``."""
    path = os.path.join(folder, "g++")
    with open(path, "w") as script:
        script.write(f"#!/bin/sh\necho '{prints}'\n")
    os.chmod(path, 0o755)
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_setup_links_the_loaded_libstdcxx_where_the_compiler_has_only_the_static_one(tmp_path, monkeypatch):
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)  # setup.py's helpers, not a build
    build = runpy.run_path(os.path.join(ROOT, "setup.py"))
    loaded = build["loaded_libstdcxx"]()
    assert loaded is not None and os.path.exists(loaded) and "/libstdc++.so.6" in loaded, loaded
    static_only = fake_compiler(tmp_path, "libstdc++.so")  # gcc's answer when it finds no such file
    assert build["shared_libstdcxx_flags"](static_only) == [f"-L{os.path.dirname(loaded)}",
                                                         f"-l:{os.path.basename(loaded)}"]
    shared = fake_compiler(tmp_path, loaded)  # it finds one: -lstdc++ links it, nothing to add
    assert build["shared_libstdcxx_flags"](shared) == []
    assert build["shared_libstdcxx_flags"](str(tmp_path / "no-such-g++")) == []
