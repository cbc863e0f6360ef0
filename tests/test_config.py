"""Model presets."""
import numpy as np
import pytest

from sparse_mla.config import get_config


def test_v4_flash_preset():
    cfg = get_config("deepseek-v4-flash")
    assert (cfg.num_heads, cfg.head_dim, cfg.nope_dim, cfg.window, cfg.index_topk) == (64, 512, 448, 128, 512)
    assert cfg.num_layers == 44  # 43 layers + the MTP layer of the recipe
    assert [cfg.layer_kind(i) for i in range(5)] == ["swa", "swa", "c4a", "c128a", "c4a"]
    assert cfg.layer_kind(cfg.num_layers - 1) == "swa"


def test_unknown_preset_is_a_value_error():
    with pytest.raises(ValueError, match="name must be one of"):
        get_config("deepseek-v5")


def test_v4_pro_and_v32_presets():
    pro = get_config("deepseek-v4-pro")
    assert (pro.num_heads, pro.index_topk, pro.num_layers) == (128, 1024, 62)
    assert [pro.layer_kind(i) for i in range(4)] == ["c128a", "c128a", "c4a", "c128a"]
    v32 = get_config("deepseek-v3.2")
    assert v32.head_dim == 576 and abs(v32.softmax_scale - 0.13523) < 1e-4


def test_bad_preset_names_and_layer_numbers_raise_value_error():
    with pytest.raises(ValueError, match=r"name must be one of .* got \[1\]"):
        get_config([1])
    cfg = get_config("deepseek-v4-flash")
    assert cfg.layer_kind(np.int64(2)) == cfg.layer_kind(2) == "c4a"
    for layer in (-1, cfg.num_layers, 2.0, True):
        with pytest.raises(ValueError, match=rf"layer must be an int in \[0, {cfg.num_layers}\)"):
            cfg.layer_kind(layer)
