"""The engine is parts composed (docs/architecture.md), counted from the source: a part is handed what it
uses, not the engine; the seams between layers are typed; no class gets members at run time."""

from __future__ import annotations

import abc
import ast
import enum
import importlib
import pathlib
import pkgutil
import typing

import rlharvest

PACKAGE = pathlib.Path(rlharvest.__file__).parent
ENGINE = PACKAGE / "collectors" / "engine"
#: the engines themselves wire the parts; every other module under collectors/engine/ is a part
ENGINE_FILES = {"engine.py", "local.py", "__init__.py"}
#: the names of the seams between layers (a leading underscore counts as the same name)
SEAMS = {"engine", "options", "face", "collector", "parent", "spec"}


def _trees(folder: pathlib.Path, pattern: str = "**/*.py") -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE.parent)): ast.parse(p.read_text()) for p in sorted(folder.glob(pattern))}


def _parts() -> dict[str, ast.Module]:
    return {name: tree for name, tree in _trees(ENGINE, "*.py").items()
            if pathlib.Path(name).name not in ENGINE_FILES}


def engine_back_reads() -> list[str]:
    """Every ``engine.x`` / ``self.engine.x`` / ``self._engine.x`` in a part under collectors/engine/ (the
    engine files excepted), as ``file:line expression``. The same count as the before-stop hook's."""
    found = []
    for name, tree in _parts().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                held = node.value
                if (isinstance(held, ast.Name) and held.id in ("engine", "_engine")) or \
                        (isinstance(held, ast.Attribute) and held.attr in ("engine", "_engine")):
                    found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_part_reads_through_an_engine_reference():
    assert engine_back_reads() == [], "a part is handed the collaborators it uses (docs/architecture.md)"


def test_no_part_imports_an_engine():
    package = "rlharvest.collectors.engine"
    engines = {f"{package}.{n[:-3]}" for n in ENGINE_FILES - {"__init__.py"}}
    engines |= {f"{package}.CollectionEngine", f"{package}.LocalEngine"}  # as the package exports them
    found = []
    for name, tree in _parts().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    module = ".".join(package.split(".")[: 4 - node.level] + [module]).rstrip(".")
                targets = {module} | {f"{module}.{a.name}" for a in node.names}
                if targets & engines:
                    found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert found == []


#: the part that says what a backend's options hand the engine (the seam itself)
OPTIONS_SEAM = "contract.py"


def _options_types() -> set[str]:
    """The collector's arguments and options as types: ``CollectorConfig``, the engine's ``EngineOptions``
    and every options class of collectors/options/."""
    options = _trees(PACKAGE / "collectors" / "options", "*.py").values()
    return {"CollectorConfig", "EngineOptions"} | {
        n.name for tree in options for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name.endswith("Options")}


def parts_given_options() -> list[str]:
    """Every parameter or field of a part under collectors/engine/ (the engines and their contract with
    the options excepted) whose annotation names the collector's arguments or options, and every import
    of them there: the engines hand each part the fields it reads (docs/architecture.md), so a part that
    does not size batches holds no ``frames_per_batch``."""
    kinds = _options_types()
    found = []
    for name, tree in _parts().items():
        if pathlib.Path(name).name == OPTIONS_SEAM:
            continue
        for node in ast.walk(tree):
            annotations = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                annotations = [(f"{node.name}({a.arg})", a.annotation) for a in
                               [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.annotation is not None]
            elif isinstance(node, ast.AnnAssign):
                annotations = [(ast.unparse(node.target), node.annotation)]
            elif isinstance(node, ast.ImportFrom) and kinds & {a.name for a in node.names}:
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
            for what, annotation in annotations:
                if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                    annotation = ast.parse(annotation.value, mode="eval").body
                named = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)}
                if named & kinds:
                    found.append(f"{name}:{node.lineno} {what}")
    return found


def test_no_part_is_given_the_collectors_arguments_whole():
    assert parts_given_options() == [], "hand a part the fields it reads (docs/architecture.md)"


def test_the_options_of_a_collector_with_workers_hold_no_batch_size():
    """``frames_per_batch`` is parsed apart (``FramesPerBatch``) and split into the ``BatchShares`` that
    only the engine's ``BatchSizes``, its autoscaler and the workers' specs read: the options every
    part is built from hold no batch size, for every backend (docs/architecture.md, "One walk")."""
    import dataclasses
    import inspect

    from rlharvest.collectors import Collector
    from rlharvest.collectors.options.async_batched import AsyncBatchedConfig, AsyncBatchedOptions
    from rlharvest.collectors.options.mp import WorkerProcessOptions
    from rlharvest.collectors.options.nodes import NodeOptions
    from rlharvest.collectors.options.ray import RayOptions
    from rlharvest.collectors.options.rpc import RPCOptions
    from rlharvest.collectors.options.torchdist import TorchDistOptions
    from rlharvest.envs import CountingEnv

    classes = [WorkerProcessOptions, NodeOptions, TorchDistOptions, RPCOptions, RayOptions, AsyncBatchedOptions,
               AsyncBatchedConfig]
    assert {cls.__name__: [f.name for f in dataclasses.fields(cls) if "frames" in f.name] for cls in classes} == {
        cls.__name__: [] for cls in classes}
    for parse in (WorkerProcessOptions.parse, NodeOptions.parse_common, AsyncBatchedOptions.parse):
        assert "frames_per_batch" not in inspect.signature(parse).parameters, parse.__qualname__
    options = WorkerProcessOptions.parse("MultiSyncCollector", sync=True, create_env_fn=[CountingEnv] * 2,
                                         num_workers=None, policy=None, policy_factory=None,
                                         default_collector=Collector, total_frames=16)
    assert options.config.frames_per_batch is None


def _mentions_any(annotation: ast.expr | None) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return annotation is not None and any(
        (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(annotation))


def untyped_seams() -> list[str]:
    """Every parameter named for a seam (``engine``, ``options``, ``face``, ``collector``, ``parent``,
    ``spec``, with or without a leading underscore) that has no annotation or one that mentions ``Any``
    (``Any``, ``Any | None``, ``Sequence[Any]``, ...), and every annotated attribute or variable of those
    names whose annotation mentions ``Any``, anywhere in rlharvest/."""
    found = []
    for name, tree in _trees(PACKAGE).items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, [args.vararg, args.kwarg])]:
                    if arg.arg.lstrip("_") in SEAMS and (arg.annotation is None or _mentions_any(arg.annotation)):
                        found.append(f"{name}:{node.lineno} {node.name}({arg.arg})")
            elif isinstance(node, ast.AnnAssign):
                target = node.target
                held = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
                if held.lstrip("_") in SEAMS and _mentions_any(node.annotation):
                    found.append(f"{name}:{node.lineno} {ast.unparse(target)}")
    return found


def test_seams_are_typed():
    assert untyped_seams() == []


def _class_valued(node: ast.expr, classes: set[str], class_params: set[str]) -> bool:
    """Whether ``node`` names a class: a class defined in rlharvest/, a parameter holding one (``cls``,
    ``mcs``, ``metacls`` or annotated ``type``/``type[...]``), ``type(x)`` or ``x.__class__``."""
    if isinstance(node, ast.Name):
        return node.id in classes or node.id in class_params
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type":
        return len(node.args) == 1
    return isinstance(node, ast.Attribute) and node.attr == "__class__"


def _class_params(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for arg in function.args.posonlyargs + function.args.args + function.args.kwonlyargs:
        annotation = arg.annotation
        if isinstance(annotation, ast.Subscript):
            annotation = annotation.value
        if arg.arg in ("cls", "mcs", "metacls") or (isinstance(annotation, ast.Name)
                                                    and annotation.id in ("type", "Type")):
            names.add(arg.arg)
    return names


def _writes_to_classes(function: ast.AST, classes: set[str], params: set[str]) -> list[ast.AST]:
    writes = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            func = node.func
            through = isinstance(func, ast.Name) and func.id in ("setattr", "delattr")
            through |= isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__") and \
                isinstance(func.value, ast.Name) and func.value.id in ("object", "type")
            if through and node.args and _class_valued(node.args[0], classes, params):
                writes.append(node)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            writes += [node for t in targets
                       if isinstance(t, ast.Attribute) and _class_valued(t.value, classes, params)]
    return writes


def class_writes() -> list[str]:
    """Every statement in rlharvest/ that sets (or deletes) an attribute of a class after its body ran:
    ``setattr``/``delattr``/``object.__setattr__``/``type.__setattr__`` whose first argument is a class,
    and ``C.name = value`` (or ``+=``) on one, where a class is what :func:`_class_valued` says. Setting
    attributes of instances (``self``, a user's env) is not counted."""
    trees = _trees(PACKAGE)
    classes = {n.name for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    found = []
    for name, tree in trees.items():
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        scopes = [(tree, set())] + [(f, _class_params(f)) for f in functions]
        for scope, params in scopes:
            found += {f"{name}:{n.lineno} {ast.unparse(n)[:100]}" for n in _writes_to_classes(scope, classes, params)}
    return sorted(set(found))


def test_no_class_gets_attributes_set_from_outside_its_body():
    assert class_writes() == []


def _machinery() -> set[str]:
    """The members Python's own class machinery adds to a class (ABC, Protocol, NamedTuple, Enum)."""
    class Abstract(abc.ABC):
        pass

    class Typed(typing.Protocol):
        pass

    class Pair(typing.NamedTuple):
        first: int

    class Kind(enum.Enum):
        ONE = 1

    return {n for c in (Abstract, Typed, Pair, Kind) for n in vars(c)} - {"first", "ONE"}


def _body_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for statement in node.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            bound = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            names |= bound
            if "__slots__" in bound and statement.value is not None:  # each slot is a member
                names |= {n.value for n in ast.walk(statement.value) if isinstance(n, ast.Constant)}
    return names


def _class_bodies(tree: ast.Module) -> dict[str, set[str]]:
    """``{qualified name: names its body binds}`` for every class written in a module."""
    bodies: dict[str, set[str]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                bodies[prefix + child.name] = _body_names(child)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}{child.name}.<locals>.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return bodies


def members_not_in_class_bodies() -> list[str]:
    """Imports every module of rlharvest and lists each member of each class it defines at its top level
    (dunders and what Python's machinery adds excepted) that the class's own body does not write: a
    member some code added at run time, whatever the spelling."""
    machinery, found = _machinery(), []
    for info in pkgutil.walk_packages([str(PACKAGE)], "rlharvest."):
        module = importlib.import_module(info.name)
        bodies = _class_bodies(ast.parse(pathlib.Path(module.__file__).read_text()))
        for cls in vars(module).values():
            if not (isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            body = bodies.get(cls.__qualname__)
            if body is None:
                found.append(f"{module.__name__}.{cls.__qualname__}: not written as a class statement")
                continue
            added = [n for n in vars(cls) if not (n.startswith("__") and n.endswith("__"))
                     and n not in body and n not in machinery]
            found += [f"{module.__name__}.{cls.__qualname__}.{n}" for n in added]
    return found


def test_every_member_of_a_class_is_written_in_its_body():
    assert members_not_in_class_bodies() == []
