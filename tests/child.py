"""The environment of a child python that must import the kvcache_ext this test process imports."""
import os
import site
import socket

import kvcache_ext

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvcache_ext.__file__)))


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` plus ``extra``, with the folder holding kvcache_ext put first on PYTHONPATH
    when it is a source tree (built in place). An installed kvcache_ext lies in a site-packages
    folder that the child finds by itself: putting that folder on PYTHONPATH would also put it
    before a venv's own site-packages, so that CI's oldest-transformers venv (made with
    --system-site-packages) would load the newest transformers in its children."""
    site_dirs = {os.path.realpath(d) for d in [*site.getsitepackages(), site.getusersitepackages()]}
    first = [] if os.path.realpath(PACKAGE_ROOT) in site_dirs else [PACKAGE_ROOT]
    path = os.pathsep.join(filter(None, [*first, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, **extra)
    if path:
        env["PYTHONPATH"] = path
    return env


def free_port() -> int:
    """A TCP port of this machine that nothing listens on now (for a child server or process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
