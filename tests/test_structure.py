"""The package's structure, read from its source: its layers only look down (no module imports
one of a higher layer, lazy imports included), no import cycle between its modules, every
module importable on its own, and every object's attributes written by its own class only
(``self.x = ...`` inside a method), so that each piece of state has one owner."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import kvcache_ext

PACKAGE = Path(kvcache_ext.__file__).resolve().parent
NAME = PACKAGE.name

# Entry scripts: importing them runs the command.
NOT_IMPORTED_ALONE = {f"{NAME}.__main__"}
try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: F401
except ImportError:   # transformers 5.2: kvcache_ext.serving raises an ImportError that says what it lacks
    NOT_IMPORTED_ALONE |= {f"{NAME}.serving", f"{NAME}.serving.manager", f"{NAME}.serving.cache",
                           f"{NAME}.serving.attention", f"{NAME}.serving.admission", f"{NAME}.serving.server",
                           f"{NAME}.serving.load", f"{NAME}.serving.validation", f"{NAME}.serving.sampling",
                           f"{NAME}.serving.disconnect"}

# The few places that must write attributes of an object they do not own, each with its reason:
# (module, enclosing function, target as written) -> why.
PATCHES_THE_MODEL = ("patching an HF model puts kvcache_ext's own methods on the model instance "
                     "(transformers offers no hook for them) and unpatch takes them off again")
PRESS_RATIO = ("a kvpress press's ratio is its public dataclass field; one press, scored once, is "
               "compressed at each budget's ratio in turn")
SWAPS_A_PRESS_METHOD = ("the replay of a kvpress press swaps one of its methods (its compress, its scorer's "
                        "score, KVzip's compress_post) on the instance for the time of a block, restored after")
THREAD_LOCAL = ("hf/cache.py's own per-thread state (threading.local has no methods: it is written by "
                "attribute; a subclass with methods is traced by torch.compile, which then breaks the "
                "update()-to-attention handshake: tests/test_ops.py's torch.compile test)")
SERVE_BUILDS_BY_NAME = ("transformers serve builds its model manager and its app by name inside Serve's "
                        "constructor (no hook): kvcache-ext serve puts its subclass and wrapper there while "
                        "Serve is built, and puts the originals back")
SERVE_WRAPS_A_REQUEST = ("transformers' server has no hook around a request: kvcache-ext serve wraps, on the "
                         "server's own objects (its handlers, its generation state, the engine manager that state "
                         "makes), the methods a request passes through, to check it first and sample it with its "
                         "own settings; the engine's config is the state's, read when it makes that manager")
ALLOWED_FOREIGN_WRITES = {
    (f"{NAME}.hf.patching", "patch", "model._prepare_cache_for_generation"): PATCHES_THE_MODEL,
    (f"{NAME}.hf.patching", "patch", "setattr(model, _HANDLE_ATTR)"): PATCHES_THE_MODEL,
    (f"{NAME}.hf.patching", "patch", "model._kvcache_ext_forward"): PATCHES_THE_MODEL,
    (f"{NAME}.hf.patching", "patch", "model.forward"): PATCHES_THE_MODEL,
    (f"{NAME}.hf.patching", "unpatch", "model._prepare_cache_for_generation"): PATCHES_THE_MODEL,
    (f"{NAME}.hf.patching", "unpatch", "model.forward"): PATCHES_THE_MODEL,
    (f"{NAME}.hf.patching", "unpatch", "model._kvcache_ext_forward"): PATCHES_THE_MODEL,
    (f"{NAME}.hf.patching", "unpatch", "delattr(model, _HANDLE_ATTR)"): PATCHES_THE_MODEL,
    (f"{NAME}.hf.models", "load_model", "tokenizer.pad_token"):
        "the loader sets the public settings of the tokenizer it has just made (left padding, a pad token)",
    (f"{NAME}.hf.models", "load_model", "tokenizer.padding_side"):
        "the loader sets the public settings of the tokenizer it has just made (left padding, a pad token)",
    (f"{NAME}.hf.models", "load_model", "model.generation_config.pad_token_id"):
        "the loader gives the model it has just made the tokenizer's pad token for generate",
    (f"{NAME}.evaluation.kvpress_runs", "kvzip_tokenizer", "kvzip_press.AutoTokenizer"):
        "kvpress's KVzipPress loads its tokenizer by the model's name, which a GGUF model does not have: "
        "while it runs, its module's loader hands it the tokenizer the run has (restored after)",
    (f"{NAME}.evaluation.kvpress_runs", "_ScorerReplay", "self.press.compression_ratio"):
        PRESS_RATIO,
    (f"{NAME}.evaluation.kvpress_runs", "_KVzipReplay", "self.press.compression_ratio"):
        PRESS_RATIO,
    (f"{NAME}.evaluation.kvpress_runs", "_ScorerReplay", "kept.keys"):
        "a press's compressed keys go into HF's cache layer as kvpress's own forward hook writes them",
    (f"{NAME}.evaluation.kvpress_runs", "_ScorerReplay", "kept.values"):
        "a press's compressed values go into HF's cache layer as kvpress's own forward hook writes them",
    (f"{NAME}.evaluation.kvpress_runs", "_KVzipReplay", "self.press.score_val"):
        "KVzip's compress_post reads its scores from the press (and writes into them): each budget hands "
        "it a copy of the scores its passes left",
    (f"{NAME}.evaluation.kvpress_runs", "_instead", "setattr(obj, name)"):
        SWAPS_A_PRESS_METHOD,
    (f"{NAME}.evaluation.kvpress_runs", "_instead", "delattr(obj, name)"):
        SWAPS_A_PRESS_METHOD,
    (f"{NAME}.evaluation.kvpress_runs", "unmask", "layer.self_attn.masked_key_indices"):
        "kvpress's Ada-KV presses leave their mask on the attention modules (kvpress's own state, which "
        "it never clears): the next run must not read it",
    (f"{NAME}.hf.cache", "enter_patched_forward", "_forward.depth"): THREAD_LOCAL,
    (f"{NAME}.hf.cache", "exit_patched_forward", "_forward.depth"): THREAD_LOCAL,
    (f"{NAME}.hf.cache", "take_pending", "_pending.entry"): THREAD_LOCAL,
    (f"{NAME}.hf.cache", "set_pending", "_pending.entry"): THREAD_LOCAL,
    (f"{NAME}.hf.patching", "patch", "model.init_continuous_batching"): PATCHES_THE_MODEL,
    (f"{NAME}.serving.cache", "RaggedPagedCache.adopt", "cache.__class__"):
        "the continuous batching engine's cache becomes a RaggedPagedCache in place: the engine's scheduler, "
        "batch processor and inputs all hold that one object, and building it again would copy the engine's code",
    (f"{NAME}.serving.manager", "RaggedBatchingManager._create_batch_processor", "processor.scheduler.__class__"):
        "the engine's scheduler becomes its admitting subclass in place, for the same reason as the cache",
    (f"{NAME}.serving.manager", "RaggedBatchingManager._create_batch_processor", "config.num_blocks"):
        "the manager's own copy of the engine's configuration (made in __init__), from which the engine builds "
        "its cache: num_blocks is set around that construction, as the engine itself sets it after",
    (f"{NAME}.serving.server", "serve_hooks", "model_manager.ModelManager"): SERVE_BUILDS_BY_NAME,
    (f"{NAME}.serving.server", "serve_hooks", "server.build_server"): SERVE_BUILDS_BY_NAME,
    (f"{NAME}.serving.server", "build_server_checked", "handler.handle_request"): SERVE_WRAPS_A_REQUEST,
    (f"{NAME}.serving.sampling", "serve_per_request", "generation_state._cb_config"): SERVE_WRAPS_A_REQUEST,
    (f"{NAME}.serving.sampling", "serve_per_request", "generation_state.get_manager"): SERVE_WRAPS_A_REQUEST,
    (f"{NAME}.serving.sampling", "serve_per_request", "manager.init_cb"): SERVE_WRAPS_A_REQUEST,
    (f"{NAME}.serving.sampling", "serve_per_request", "manager._cb.add_request"): SERVE_WRAPS_A_REQUEST,
    (f"{NAME}.serving.server", "stop", "serve.server.force_exit"):
        "uvicorn's server is stopped by its flags (should_exit, force_exit): it has no method for it",
    (f"{NAME}.checks", "check_fields", "object.__setattr__(obj, name)"):
        "every dataclass calls check_fields(self, ...) from its own __post_init__ to store its checked "
        "fields (object.__setattr__: frozen dataclasses too)",
}


def modules() -> dict[str, Path]:
    """Every Python module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = (NAME,) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def extensions() -> set[str]:
    """The compiled modules (``_C``): imported like the others, importing nothing of the package."""
    return {".".join((NAME,) + path.relative_to(PACKAGE).parent.parts + (path.name.split(".")[0],))
            for pattern in ("*.so", "*.pyd") for path in PACKAGE.rglob(pattern)}


def imported(name: str, path: Path, known) -> set[str]:
    """The package's modules that ``name`` imports anywhere (inside functions too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from a import b`` imports the module a.b when there is one, else a's name b.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


# The package's layers, top first (docs/architecture.md): a module may import modules of its own
# layer and of the layers below it, never of one above. Keyed by the module's first name under
# the package; the package itself (kvcache_ext/__init__.py, the public API) is the top.
LAYERS = (
    ("",),                                   # the package: the public API, where the layers meet
    ("__main__", "cli"),                     # the command
    ("serving", "evaluation"),               # continuous batching and the server; the harness
    ("hf",),                                 # transformers: patch, the cache, the model loader
    ("engine",),                             # one layer's attention call with its policy
    ("policies", "kernels"),                 # what the engine asks; the ops' Python doors
    ("reference", "tasks", "checks", "cache_argument", "data", "_C"),   # leaves
)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of a module of the package (0: the top)."""
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else ""
    for index, names in enumerate(LAYERS):
        if first in names:
            return index
    raise AssertionError(f"{module} is in no layer of LAYERS: add its folder to one")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module of a higher layer, as "a -> b"."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) < layer_of(a))


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {name: imported(name, path, set(known) | extensions()) for name, path in known.items()}
    graph.update({name: set() for name in extensions()})
    return graph


def test_upward_imports_are_found(tmp_path):
    """A planted upward import is reported, a lazy one (inside a function) included."""
    graph = import_graph()
    assert upward_imports(graph) == []
    planted = tmp_path / "state.py"
    planted.write_text("import torch\n\ndef later():\n    from kvcache_ext.hf.cache import RaggedCache\n"
                       "    return RaggedCache\n")
    graph[f"{NAME}.engine.state"] |= imported(f"{NAME}.engine.state", planted, set(modules()))
    assert upward_imports(graph) == [f"{NAME}.engine.state -> {NAME}.hf.cache"]


def test_layers_only_look_down():
    """No module imports one of a higher layer (``LAYERS``), lazy imports included."""
    upward = upward_imports(import_graph())
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_between_the_package_modules():
    graph = import_graph()
    assert graph[f"{NAME}.hf.cache"], "the import graph came out empty: the parser misses imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_on_its_own():
    """Each module imported first, in an interpreter where no other module of the package is
    loaded (torch and transformers stay loaded: they are not what is tested)."""
    names = [name for name in modules() if name not in NOT_IMPORTED_ALONE]
    script = (
        "import importlib, sys, traceback\n"
        "import torch, transformers\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        f"    for loaded in [m for m in sys.modules if m.split('.')[0] == {NAME!r} and m != {NAME + '._C'!r}]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc(limit=-3))\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE.parent),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True,
                          env=env, cwd=PACKAGE.parent, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def foreign_writes(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(enclosing function, target, line) of every write to an attribute that is not the
    writing method's own object's: assignments (``=``, ``+=``, annotated), ``del`` and
    ``setattr``/``delattr``/``object.__setattr__`` calls. Only ``self.x`` / ``cls.x`` inside a
    class's method passes."""
    out = []

    def own(target: ast.expr, in_method: bool) -> bool:
        return in_method and isinstance(target, ast.Name) and target.id in ("self", "cls")

    def flat(targets):
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                yield from flat(t.elts)
            elif isinstance(t, ast.Starred):
                yield from flat([t.value])
            else:
                yield t

    def visit(node, function: str, in_method: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{function}.{child.name}".lstrip("."), False)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                method = isinstance(node, ast.ClassDef) or in_method
                label = getattr(child, "name", "<lambda>")
                visit(child, f"{function}.{label}".lstrip(".") if not in_method else function, method)
                continue
            targets = []
            if isinstance(child, ast.Assign):
                targets = list(flat(child.targets))
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            elif isinstance(child, ast.Delete):
                targets = list(flat(child.targets))
            for t in targets:
                if isinstance(t, ast.Attribute) and not own(t.value, in_method):
                    out.append((function, ast.unparse(t), child.lineno))
            if isinstance(child, ast.Call) and child.args:
                called = ast.unparse(child.func)
                if called in ("setattr", "delattr", "object.__setattr__", "object.__delattr__"):
                    if not own(child.args[0], in_method):
                        shown = ", ".join(ast.unparse(a) for a in child.args[:2])
                        out.append((function, f"{called}({shown})", child.lineno))
            visit(child, function, in_method)

    visit(ast.parse(path.read_text(), str(path)), "", False)
    return out


def test_foreign_writes_are_found(tmp_path):
    source = ("class A:\n    def f(self, other):\n        self.x = 1\n        other.y = 2\n"
              "        def g():\n            self.z = 3\n"
              "def h(state):\n    state.seen += 1\n    a, state.b = 1, 2\n    setattr(state, 'c', 3)\n"
              "    del state.d\n")
    path = tmp_path / "sample.py"
    path.write_text(source)
    found = [(f, t) for f, t, _ in foreign_writes("sample", path)]
    assert found == [("A.f", "other.y"), ("h", "state.seen"), ("h", "state.b"),
                     ("h", "setattr(state, 'c')"), ("h", "state.d")]


def test_no_module_writes_another_objects_attributes():
    """State has one owner: outside the few writes ``ALLOWED_FOREIGN_WRITES`` lists (with why),
    an object's attributes are assigned by its own class's methods only."""
    found, used = [], set()
    for name, path in modules().items():
        for function, target, line in foreign_writes(name, path):
            key = (name, function.split(".")[0] if function else "", target)
            if (name, function, target) in ALLOWED_FOREIGN_WRITES:
                used.add((name, function, target))
            elif key in ALLOWED_FOREIGN_WRITES:
                used.add(key)
            else:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({function or 'module'}): {target}")
    assert not found, "attributes written outside their object's class:\n" + "\n".join(found)
    assert used == set(ALLOWED_FOREIGN_WRITES), f"allowed but no longer written: {set(ALLOWED_FOREIGN_WRITES) - used}"
