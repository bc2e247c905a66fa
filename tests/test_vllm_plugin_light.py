"""The vLLM plugin's parts that need no vLLM: a light entry point and the ``darts`` config type.

The ``darts`` section's check is the shipped ``modeling_darts.py``'s; ``test_export.py`` puts the
same bad sections through transformers' ``from_pretrained``.

The engine-side tests (log-probs under batching, ``lm_eval --model vllm``, ``vllm serve``) live
in ``tests_vllm/`` and run in their own virtualenv with ``make test-vllm``.
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from reference import BAD_SECTIONS
from transformers import AutoModelForCausalLM, LlamaConfig

from mergekit_darts.correction import modeling_darts
from mergekit_darts.hosts.vllm_plugin.config import VllmDartsConfig, darts_section

ROOT = Path(__file__).parents[1]
DARTS = {
    "format": "darts-export",
    "version": 1,
    "base_model_type": "llama",
    "base_architecture": "LlamaForCausalLM",
    "task": "math",
    "module": "pos_corr",
    "rank": 4,
    "max_positions": 12,
    "hidden_size": 64,
    "prefix": "darts_surgery.",
}


def exported_config() -> dict[str, Any]:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, vocab_size=50).to_dict()
    config.update(
        model_type="darts",
        architectures=["DartsLlamaForCausalLM"],
        darts=copy.deepcopy(DARTS),
    )
    return config


@pytest.mark.slow
def test_entry_point_imports_nothing_heavy_until_vllm_calls_it() -> None:
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = entry["vllm.general_plugins"]["mergekit-darts"]
    module, _, function = target.partition(":")
    code = (
        f"import sys, {module} as m; assert callable(m.{function}); "
        "print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_darts_config_is_the_base_config_plus_the_darts_section() -> None:
    # what AutoConfig calls once the plugin has registered VllmDartsConfig for "darts" (not done
    # here: the registration would outlive this test and change how other tests' exports load)
    config = VllmDartsConfig.from_dict(exported_config())
    assert isinstance(config, LlamaConfig) and type(config).__name__ == "DartsLlamaConfig"
    assert (config.hidden_size, config.num_attention_heads, config.vocab_size) == (64, 4, 50)
    assert config.darts == DARTS and config.model_type == "darts"
    again = pickle.loads(pickle.dumps(config))  # how vLLM ships it to its workers
    assert type(again) is type(config) and again.to_dict() == config.to_dict()
    # plain transformers still refuses to load the folder as an uncorrected Llama
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        AutoModelForCausalLM.from_config(config)


ROUTED = {
    "module": "routed",
    "routed": {
        "tasks": [
            {"name": "math", "module": "pos_corr", "rank": 4, "max_positions": 12},
            {"name": "chat", "module": "none", "rank": 16, "max_positions": 512},
        ],
        "background": True,
    },
}


def test_a_routed_and_a_none_config_read_as_a_single_one_does() -> None:
    config = exported_config()
    for key in ("task", "module", "rank", "max_positions"):
        del config["darts"][key]
    config["darts"].update(copy.deepcopy(ROUTED))
    loaded = VllmDartsConfig.from_dict(config)
    assert type(loaded).__name__ == "DartsLlamaConfig" and loaded.darts == config["darts"]
    again = pickle.loads(pickle.dumps(loaded))
    assert again.to_dict() == loaded.to_dict()
    surgery = modeling_darts.surgery_for(loaded)
    assert type(surgery).__name__ == "RoutedSurgery"
    assert sorted(surgery.state_dict()) == [
        "corrections.0.down.weight",
        "corrections.0.position_bias",
        "corrections.0.up.weight",
        "router.bias",
        "router.weight",
    ]
    assert surgery.router.weight.shape == (3, 64)  # two tasks and the background class
    none = exported_config()
    none["darts"]["module"] = "none"
    assert dict(modeling_darts.surgery_for(VllmDartsConfig.from_dict(none)).state_dict()) == {}


@pytest.mark.parametrize("change, message", BAD_SECTIONS)
def test_a_bad_darts_section_gets_a_one_line_error(change: dict, message: str) -> None:
    assert darts_section is modeling_darts.darts_section  # the plugin checks what transformers does
    config = exported_config()
    config["darts"].update(change)
    with pytest.raises(ValueError, match=message) as info:
        darts_section(config)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        VllmDartsConfig.from_dict(config)


def test_no_darts_section_at_all() -> None:
    config = exported_config()
    del config["darts"]
    with pytest.raises(ValueError, match="mergekit-darts export"):
        VllmDartsConfig.from_dict(config)


HEAVY = {"rich", "click", "pydantic", "mergekit", "lm_eval", "lm_eval_darts"}
SHIPPED = "mergekit_darts.correction.modeling_darts"
# what the shipped file imports relatively: its neighbour, the other shipped file
CORRECTION = {"mergekit_darts.correction", "mergekit_darts.correction.darts_correction"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, loaded",
    [
        (SHIPPED, CORRECTION),
        (
            "mergekit_darts.hosts.vllm_plugin.config",
            {"mergekit_darts.hosts", "mergekit_darts.hosts.vllm_plugin", SHIPPED, *CORRECTION},
        ),
    ],
)
def test_the_shipped_file_and_the_plugin_config_load_nothing_else(module: str, loaded: set) -> None:
    """Every vLLM worker imports the config: none of the CLI's or the calibration's libraries."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = set(json.loads(out.stdout))
    assert not {name.split(".")[0] for name in modules} & HEAVY
    ours = {name for name in modules if name.split(".")[0] == "mergekit_darts"}
    assert ours == {"mergekit_darts", module} | loaded
