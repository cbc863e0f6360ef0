"""Model presets."""
import numpy as np
import pytest

from sparse_mla.config import check_scope_formats, complete_entries, get_config


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


def test_the_v41_flash_preset_names_every_layer_s_sources():
    cfg = get_config("deepseek-v4.1-flash")
    assert (cfg.num_layers, cfg.num_heads, cfg.window, cfg.index_topk, cfg.kv_format) == (40, 64, 128, 512, "fp8_v41")
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    assert kinds == ["swa"] * 2 + ["c2a"] * 18 + ["c1a"] * 20
    assert [cfg.kv_source_layer(i) for i in (0, 1, 2, 7, 8, 13, 14, 19, 20, 39)] == \
        [None, None, 2, 2, 8, 8, 14, 14, 20, 20]
    assert [cfg.index_source_layer(i) for i in (1, 2, 9, 20, 23, 24, 31, 36, 39)] == \
        [None, 2, 8, 20, 20, 24, 28, 36, 36]
    # a source layer's kind is its readers' kind: one cache per source, one block table per kind
    for layer in range(2, cfg.num_layers):
        assert kinds[cfg.kv_source_layer(layer)] == kinds[layer] == kinds[cfg.index_source_layer(layer)]
    v4 = get_config("deepseek-v4-flash")
    assert v4.kv_source_layer(2) == 2 and v4.index_source_layer(2) == 2 and v4.kv_source_layer(0) is None


def test_the_visibility_rule_and_the_scope_format_pairs():
    # entry w of ratio r is visible to position p iff (w+1)·r <= p+1: the first complete_entries(p+1, r) entries
    for r in (1, 2, 4, 128):
        for p in range(300):
            assert complete_entries(p + 1, r) == sum(1 for w in range(300) if (w + 1) * r <= p + 1)
    for pair in (("fp8_v41", "fp8_v41"), ("fp8_v41", "fp4_v41"), ("fp8_v41_planar", "fp4_v41"),
                 ("fp4_v41", "fp4_v41_planar"), ("fp8_v4", "fp8_v4")):
        check_scope_formats(*pair)
    for pair in (("fp4_v41", "fp8_v41"), ("fp8_v4", "fp4_v41"), ("bf16", "fp8_v41"), ("fp8_v41", "fp8_v4")):
        with pytest.raises(ValueError, match=f"cache format mismatch: kv holds {pair[0]}, extra_kv {pair[1]}"):
            check_scope_formats(*pair)


def test_a_model_config_names_bad_ratios_and_sources():
    """Ratios the family has no kind for were a KeyError at layer_kind; a source id out of range, or on a layer of the
    wrong kind (a window-only layer as a kv source), gave later layers wrong roles silently."""
    import dataclasses

    v41 = get_config("deepseek-v4.1-flash")
    for change, match in ((dict(compress_ratios=(2,)), r"compress_ratios of a v4 model must be in \(1, 4, 128\)"),
                          (dict(compress_ratios=()), "compress_ratios must be a non-empty tuple"),
                          (dict(window=0, compress_ratios=(-4,)), "compress_ratios must be a non-empty tuple of ints"),
                          (dict(window=-1), "window must be an int >= 0")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(get_config("deepseek-v4-flash"), **change)
    for change, match in ((dict(compress_ratios=(0, 2, 4) + v41.compress_ratios[3:]), "must be in"),
                          (dict(kv_source_layer_ids=(-5,)), r"kv_source_layer_ids must be a tuple of layer ids"),
                          (dict(kv_source_layer_ids=(2, 99)), r"kv_source_layer_ids must be a tuple of layer ids"),
                          (dict(kv_source_layer_ids=(0, 8)), r"kv_source_layer_ids names layer 0, a swa layer"),
                          (dict(index_source_layer_ids=[2, 8]), r"index_source_layer_ids must be a tuple")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(v41, **change)
    with pytest.raises(ValueError, match="ratio must be a positive int"):  # 0 divided by zero; -4 counted backwards
        complete_entries(10, 0)
    with pytest.raises(TypeError, match="format names"):
        check_scope_formats(None, "fp8_v41")


def test_a_family_is_one_the_kinds_are_named_for():
    import dataclasses

    with pytest.raises(ValueError, match=r"family must be one of \('v4', 'v4.1', 'v3.2'\), got 'v41'"):
        dataclasses.replace(get_config("deepseek-v4-flash"), family="v41")
    # a model without a sliding window is V3.2's kind whatever family it was left with
    assert dataclasses.replace(get_config("deepseek-v3.2"), family="v4").layer_kind(0) == "dsa"
