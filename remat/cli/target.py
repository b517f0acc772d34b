"""The CLI's TARGET: `path/to/file.py:factory` or `package.module:factory`, a function
returning `(model, args)` or `(model, args, kwargs)`, called with `--set name=value`
keyword arguments. Every mistake is a `TargetError` naming what to fix."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from remat.errors import RematError

FORM = "give TARGET as path/to/file.py:factory or package.module:factory"


class TargetError(RematError):
    """A TARGET or --set the CLI cannot use; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Built:
    """What a factory returned."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def load_factory(target: str) -> Callable[..., Any]:
    """The factory function TARGET names."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise TargetError(f"TARGET {target!r} has no ':factory' part; {FORM}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(Path(where), target)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise TargetError(f"TARGET {target!r}: cannot import module {where!r} ({e}); {FORM}") from None
        except Exception as e:  # importing ran the module's code, which failed
            raise TargetError(f"TARGET {target!r}: importing {where!r} raised {type(e).__name__}: {e}") from e
    factory = getattr(module, name, None)
    if factory is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise TargetError(f"TARGET {target!r}: {where} defines no {name!r}; functions there: {public}")
    if not callable(factory):
        raise TargetError(f"TARGET {target!r}: {name!r} is a {type(factory).__name__}, not a function")
    return factory


def _load_file(path: Path, target: str):
    if not path.is_file():
        raise TargetError(f"TARGET {target!r}: file {str(path)!r} does not exist; {FORM}")
    mod_name = f"remat_target_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"TARGET {target!r}: {str(path)!r} is not a Python file; {FORM}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up by name
    sys.path.insert(0, str(path.resolve().parent))  # its sibling imports work as when run
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file failed to import: one line naming it
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TargetError(f"TARGET {target!r}: importing {str(path)!r} raised {type(e).__name__}: "
                          f"{first}; fix the file (try `python {path}`)") from e
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def parse_sets(pairs: Sequence[str]) -> dict[str, Any]:
    """`['batch_size=8', 'name=gpt']` -> {'batch_size': 8, 'name': 'gpt'} (Python literals
    where they parse, else strings)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise TargetError(f"--set {pair!r} is not name=value; write e.g. --set batch_size=8")
        try:
            out[name] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            out[name] = text.strip()
    return out


def call_factory(factory: Callable[..., Any], target: str, kwargs: dict[str, Any]) -> Built:
    """Call the factory with --set keyword arguments and check what it returned."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if params and not takes_any and k not in accepted]
    if unknown:
        raise TargetError(f"--set {unknown[0]}=...: {target} takes no argument {unknown[0]!r}; "
                          f"its arguments: {accepted}")
    result = factory(**kwargs)
    return check_built(result, target)


def check_built(result: Any, target: str) -> Built:
    fix = "return (model, args) or (model, args, kwargs) with model a torch.nn.Module"
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        what = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise TargetError(f"TARGET {target!r} returned {what}; {fix}")
    model, args = result[0], result[1]
    kwargs = result[2] if len(result) == 3 else {}
    if not isinstance(model, nn.Module):
        raise TargetError(f"TARGET {target!r} returned a {type(model).__name__} as the model; {fix}")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    if not isinstance(kwargs, dict):
        raise TargetError(f"TARGET {target!r} returned kwargs of type {type(kwargs).__name__}; {fix}")
    return Built(model=model, args=tuple(args), kwargs=dict(kwargs))
