"""The ``dmuon`` TORCH_LOGS name: rewrites and skip reasons, and the kernel-source channel."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
from dmuon_compile.passes import NSChainPass, kernel_sources, register_kernel_source
from dmuon_compile.passes import kernel_source as ks

from dmuon_compile.log import logger as dmuon_logger
from dmuon_compile.log import register_torch_logs


def _chain(x):
    a = x @ x.T  # rewritten: Gram product
    b = torch.addmm(a, a, a, beta=-4.775, alpha=2.0315)  # rewritten: polynomial of a
    s = x[:, :8]
    return b @ x, s @ s  # rectangular (skipped), s·s of a non-symmetric s (skipped)


def test_debug_log_names_each_rewrite_and_each_skip(trace, dmuon_records):
    gm = trace(_chain, torch.randn(8, 12))
    NSChainPass()(gm.graph)
    text = dmuon_records.text()
    assert "-> dmuon.syrk(" in text and "Gram product" in text
    assert "-> dmuon.sym_mm(" in text and "proved equal polynomials of degree 2" in text
    assert "rectangular product" in text
    assert "not provably symmetric" in text
    assert "NS-chain pass: 2 rewrite(s)" in text


def test_torch_logs_alias_is_registered_and_applies_in_process(monkeypatch):
    from torch._logging._internal import log_registry

    register_torch_logs()
    assert log_registry.is_log("dmuon")
    assert log_registry.log_alias_to_log_qnames["dmuon"] == ["dmuon_compile"]
    monkeypatch.setenv("TORCH_LOGS", "+dmuon")
    old = dmuon_logger.level
    dmuon_logger.setLevel(logging.NOTSET)
    try:
        register_torch_logs()  # TORCH_LOGS set after `import torch`: re-applied now
        assert dmuon_logger.level == logging.DEBUG
    finally:
        monkeypatch.delenv("TORCH_LOGS")
        torch._logging._internal._init_logs()
        dmuon_logger.setLevel(old)


def test_torch_logs_module_name_works_from_the_environment():
    """``TORCH_LOGS="+dmuon_compile"`` needs no registration before ``import torch``."""
    code = (
        "import torch, dmuon_compile.passes as p\n"
        "from torch.fx.experimental.proxy_tensor import make_fx\n"
        "gm = make_fx(lambda x: x @ x.T, tracing_mode='fake')(torch.randn(4, 6))\n"
        "p.NSChainPass()(gm.graph)\n"
    )
    env = dict(os.environ, TORCH_LOGS="+dmuon_compile")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rewrite mm = mm(x_1, x_1ᵀ) -> dmuon.syrk(x_1" in out.stderr


def test_torch_logs_plus_dmuon_works_through_the_torch_backends_entry_point(tmp_path):
    """The entry point the package declares (``torch.backends``: ``dmuon_logs =
    _dmuon_torch_logs:register``) registers the name inside ``import torch``, before torch
    parses ``TORCH_LOGS``. Simulated with a throw-away dist-info on ``PYTHONPATH``."""
    dist = tmp_path / "dmuon_logs_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dmuon_logs_probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[torch.backends]\ndmuon_logs = _dmuon_torch_logs:register\n"
    )
    code = (
        "import torch, dmuon_compile.passes as p\n"
        "from torch.fx.experimental.proxy_tensor import make_fx\n"
        "gm = make_fx(lambda x: x @ x.T, tracing_mode='fake')(torch.randn(4, 6))\n"
        "p.NSChainPass()(gm.graph)\n"
    )
    base = dict(os.environ, TORCH_LOGS="+dmuon")
    base.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    root = str(Path(__file__).resolve().parents[2])  # _dmuon_torch_logs.py, installed or not
    with_ep = dict(
        base,
        PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), root, base.get("PYTHONPATH")])),
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=with_ep,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "-> dmuon.syrk(x_1" in out.stderr
    # without any registration torch rejects the name at import (why the entry point exists)
    bare = dict(base, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env=bare,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0 and "Invalid log settings" in out.stderr


def test_kernel_sources_are_logged_for_cuda_graphs(trace, dmuon_records):
    src = "@triton.jit\ndef probe_kernel(x_ptr):\n    pass  # dmuon test probe\n"
    register_kernel_source("probe_kernel", src)
    try:
        assert kernel_sources()["probe_kernel"] == src
        gm = trace(lambda x: x @ x.T, torch.randn(4, 6))
        ks.log_kernel_sources(gm.graph, {"syrk"}, devices=["cpu"])
        assert "torch reference implementation on cpu" in dmuon_records.text()
        assert "dmuon test probe" not in dmuon_records.text()  # CPU runs no Triton kernel
        ks.log_kernel_sources(gm.graph, {"syrk"}, devices=["cuda"])
        assert "dmuon kernel source probe_kernel" in dmuon_records.text()
        assert "dmuon test probe" in dmuon_records.text()
    finally:
        ks._REGISTERED.pop("probe_kernel", None)
