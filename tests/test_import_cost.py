"""A plain ``import torch`` imports nothing of ``dmuon_compile``; ``TORCH_LOGS="+dmuon"`` still
works from the environment.

torch calls every ``torch.backends`` entry point on every ``import torch``. The package's
(``_dmuon_torch_logs:register``) is declared in a throw-away dist-info on ``PYTHONPATH`` here,
so the tests hold for a source checkout as for an installed one. Control: the entry point the
package used to declare (``dmuon_compile.log:register_torch_logs``) must fail the same check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINT = "_dmuon_torch_logs:register"
OLD_ENTRY_POINT = "dmuon_compile.log:register_torch_logs"

PROBE = "import json, sys, torch\nprint(json.dumps(sorted(sys.modules)))\n"


def _env(tmp_path: Path, entry_point: str | None, **extra) -> dict:
    env = dict(os.environ, **extra)
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    paths = [str(ROOT), env.get("PYTHONPATH")]
    if entry_point is not None:
        dist = tmp_path / "dmuon_import_probe-0.0.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: dmuon_import_probe\nVersion: 0.0\n"
        )
        (dist / "entry_points.txt").write_text(f"[torch.backends]\ndmuon_logs = {entry_point}\n")
        paths.insert(0, str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


def _modules_after_import_torch(env: dict) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _ours(modules: set[str]) -> set[str]:
    return {m for m in modules if m == "dmuon_compile" or m.startswith("dmuon_compile.")}


def test_plain_import_torch_imports_nothing_of_the_package(tmp_path):
    baseline = _modules_after_import_torch(
        dict(_env(tmp_path, None), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    )
    with_ep = _modules_after_import_torch(_env(tmp_path, ENTRY_POINT))
    assert not _ours(with_ep), sorted(_ours(with_ep))[:10]
    # Nothing heavy either: what the entry point adds is its own stdlib-only module at most.
    added = {m for m in with_ep - baseline if "dmuon" in m or m.split(".")[0] == "sympy"}
    assert added <= {"_dmuon_torch_logs"}, sorted(added)[:10]


def test_control_old_entry_point_imports_the_package(tmp_path):
    with_old = _modules_after_import_torch(_env(tmp_path, OLD_ENTRY_POINT))
    assert "dmuon_compile" in _ours(with_old)


# torch 2.13 loads the torch.backends entry points before it parses TORCH_LOGS; 2.11 parses
# first, so there only the module name (which torch imports itself) works from the environment.
ENTRY_POINTS_FIRST = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def test_torch_logs_plus_dmuon_from_the_environment(tmp_path):
    """``import torch`` accepts the name without importing the package; the package's logger
    then prints the pass's rewrites at DEBUG (torch 2.11: ``+dmuon_compile``, which imports it)."""
    name = "+dmuon" if ENTRY_POINTS_FIRST else "+dmuon_compile"
    code = (
        "import sys, logging, torch\n"
        + ("assert 'dmuon_compile' not in sys.modules\n" if ENTRY_POINTS_FIRST else "")
        + "import dmuon_compile.passes as p\n"
        "from torch.fx.experimental.proxy_tensor import make_fx\n"
        "assert logging.getLogger('dmuon_compile').getEffectiveLevel() == logging.DEBUG\n"
        "gm = make_fx(lambda x: x @ x.T, tracing_mode='fake')(torch.randn(4, 6))\n"
        "p.NSChainPass()(gm.graph)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(tmp_path, ENTRY_POINT, TORCH_LOGS=name),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "-> dmuon.syrk(x_1" in out.stderr


def test_registration_only_when_torch_logs_mentions_dmuon():
    sys.path.insert(0, str(ROOT))
    try:
        import _dmuon_torch_logs as reg
    finally:
        sys.path.remove(str(ROOT))
    assert reg.mentions("+dmuon") and reg.mentions("dynamo, -dmuon")
    assert not reg.mentions("+dmuon_compile") and not reg.mentions("")


# ``import dmuon_compile`` is light (PEP 562 names): the compiler stack and DTensor load when a
# name that needs them is first used, not at the import.
HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.tensor")
PROBE_PACKAGE = (
    "import json, sys, torch\n"
    "import dmuon_compile as dmuon\n"
    "light = sorted(m for m in {heavy!r} if m in sys.modules)\n"
    "names = {{n: repr(getattr(dmuon, n)) for n in dmuon.__all__}}\n"
    "alias = getattr(dmuon, '_extract_layer_id', lambda fqn: None)\n"
    "extra = [repr(dmuon.distributed), alias('blocks.3.attn.qkv.weight')]\n"
    "heavy = sorted(m for m in {heavy!r} if m in sys.modules)\n"
    "print(json.dumps([light, heavy, names, extra, hasattr(torch.ops.dmuon, 'syrk')]))\n"
)


def _probe_package(env: dict) -> list:
    out = subprocess.run(
        [sys.executable, "-c", PROBE_PACKAGE.format(heavy=HEAVY)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_dmuon_compile_loads_no_compiler_stack(tmp_path):
    light, heavy, names, extra, ops = _probe_package(_env(tmp_path, None))
    assert light == [], light  # after `import dmuon_compile`: none of them
    # Every public name works as before (and loads what it needs on first use).
    assert "dmuon_compile.optimizer.Muon" in names["Muon"]
    assert "dedicate_params" in names["dedicate_params"] and "NewtonSchulz" in names["NewtonSchulz"]
    assert "dmuon_compile.distributed" in extra[0] and extra[1] == "blocks.3"
    assert ops  # torch.ops.dmuon.* registered at the import, as before
    assert "torch._dynamo" in heavy  # the control: the names themselves still load it


def test_control_the_eager_import_loads_the_compiler_stack(tmp_path):
    """The probe sees an eager import: importing the optimizer module at package import (what
    ``dmuon_compile/__init__.py`` did) brings Dynamo, Inductor, sympy and DTensor."""
    env = _env(tmp_path, None)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, torch, dmuon_compile.optimizer\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == repr(sorted(HEAVY))
