"""The plugin: vLLM finds ``load_format="regiontrace"`` through the ``vllm.general_plugins`` entry point, the
extra config takes only ``path``, and ``import loader`` (``loader.vllm`` included) imports no vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent


def test_importing_the_loader_imports_no_vllm():
    code = "import sys, loader, loader.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


#: run where no source tree shadows the installed project's metadata (a stale ``*.egg-info`` beside the sources)
REGISTERS = """
from importlib.metadata import entry_points
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
[plugin] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "regiontrace"]
assert plugin.value == "loader.vllm:register", plugin
register = plugin.load()
register()
register()  # vLLM loads plugins more than once per process
loader = get_model_loader(LoadConfig(load_format="regiontrace", model_loader_extra_config={"path": "s3://b/m"}))
assert type(loader).__name__ == "RegiontraceModelLoader" and loader.path == "s3://b/m", loader
assert get_model_loader(LoadConfig(load_format="regiontrace")).path is None  # the model's own folder
print("registered")
"""


def test_the_entry_point_registers_the_load_format(tmp_path):
    """vLLM finds the plugin as it does in every process it starts: the installed project's entry point."""
    out = subprocess.run([sys.executable, "-c", REGISTERS], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("registered"), out.stderr[-3000:]


def test_an_extra_config_key_it_does_not_take_is_an_error():
    from vllm.config.load import LoadConfig

    from loader.vllm.model_loader import RegiontraceModelLoader

    with pytest.raises(ValueError, match="takes only \\['path'\\]"):
        RegiontraceModelLoader(LoadConfig(load_format="regiontrace", model_loader_extra_config={"paht": "/m"}))


def test_the_default_path_is_the_models_folder_or_its_hub_repo(tmp_path):
    from types import SimpleNamespace

    from loader.vllm.model_loader import weights_path

    assert weights_path(SimpleNamespace(model=str(tmp_path), revision=None)) == str(tmp_path)
    assert weights_path(SimpleNamespace(model="org/tiny", revision=None)) == "hf://org/tiny"
    assert weights_path(SimpleNamespace(model="org/tiny", revision="v1")) == "hf://org/tiny@v1"
