"""bf16 linears packed for oneDNN: bit-identical to F.linear at every row count, with the rows oneDNN sees
rounded up to a few dozen sizes (its per-shape primitive caches then stay small); with our small-batch kernel,
its rows within bf16 rounding of F.linear and oneDNN's still bit-identical."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.packed_linear import PackedLinear, _tiles_kernels, bucket_rows, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="oneDNN packing is not available here")


def test_row_counts_fall_into_few_buckets():
    buckets = {bucket_rows(m) for m in range(1, 2049)}
    assert len(buckets) == 3 + 8 + 28 + 24  # 1, 2, 4; multiples of 8 up to 64, of 16 up to 512, of 64 to 2048
    for m in range(1, 2049):
        waste = bucket_rows(m) - m
        assert 0 <= waste < (8 if m <= 64 else 16 if m <= 512 else 64), m


@pytest.mark.parametrize("bias", [False, True])
def test_padded_rows_change_no_result(bias):
    torch.manual_seed(0)
    linear = nn.Linear(192, 320, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        for rows in (1, 5, 8, 9, 31, 64, 65, 100, 129):
            x = torch.randn(2, rows, 192, dtype=torch.bfloat16)
            got = packed(x)
            assert got.shape == (2, rows, 320)
            assert torch.equal(got, F.linear(x, linear.weight, linear.bias)), rows


def _kernel(name: str):
    """Our small-batch kernel `name` ("bf16_tiles" or "amx_linear"), or skip where this host has none."""
    kernel = next((k for k in _tiles_kernels(use_amx=True) if k.__name__.endswith("." + name)), None)
    if kernel is None:
        pytest.skip(f"no {name} kernel on this host")
    return kernel


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", ["bf16_tiles", "amx_linear"])
def test_few_rows_go_to_our_kernel(bias, name):
    kernel = _kernel(name)
    torch.manual_seed(0)
    linear = nn.Linear(192, 320, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear, [kernel])
    assert packed.tiles_kernel is kernel
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 9, kernel.MAX_ROWS, kernel.MAX_ROWS + 1):
            x = torch.randn(rows, 192, dtype=torch.bfloat16)
            got, want = packed(x), F.linear(x, linear.weight, linear.bias)
            if rows <= kernel.MAX_ROWS:
                assert torch.equal(got, kernel.linear(x, packed.weight_tiles, packed.bias_f32))
                torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=1e-2)
            else:
                assert torch.equal(got, want), rows


@pytest.mark.parametrize("name", ["bf16_tiles", "amx_linear"])
def test_the_row_limit_raced_at_load_is_honoured(name):
    kernel = _kernel(name)
    torch.manual_seed(0)
    linear = nn.Linear(192, 320).to(torch.bfloat16)
    packed = PackedLinear(linear, [kernel])
    packed.max_tile_rows = 16
    with torch.inference_mode():
        x = torch.randn(17, 192, dtype=torch.bfloat16)
        assert torch.equal(packed(x[:16]), kernel.linear(x[:16], packed.weight_tiles, packed.bias_f32))
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))  # oneDNN above the limit


def _fake_layer(max_tile_rows: int, prefetch_switch: bool = True, **more):
    """A PackedLinear as the race sees it (its timings are faked), whose kernel has a software prefetch to switch
    (bf16_tiles) or none (amx_linear)."""
    return type("Layer", (), {"in_features": 8, "weight_tiles": torch.zeros(4), "max_tile_rows": max_tile_rows,
                              "tiles_kernel": SimpleNamespace(PREFETCH_SWITCH=prefetch_switch), **more})


def test_the_race_keeps_our_kernel_up_to_its_last_win(monkeypatch):
    from pagedllm.models.layers import linear_race

    fake = _fake_layer(linear_race.RACE_ROWS[-1])
    layers = [("model.layers.0.mlp.down_proj", fake)]

    def fake_time(ours_s):
        return lambda ls, xs, tile, repeats: ours_s(next(iter(xs.values())).shape[0]) if tile else 0.02

    monkeypatch.setattr(linear_race, "_time", fake_time(lambda rows: 0.01 if rows < 64 else 0.03))
    limit, _, record = linear_race.race_tile_rows(layers)
    assert limit == 32 and [r["rows"] for r in record[1:]] == [16, 32, 64]  # after the prefetch race: lost at 64
    monkeypatch.setattr(linear_race, "_time", fake_time(lambda rows: 0.01))
    assert linear_race.race_tile_rows(layers)[0] == linear_race.RACE_ROWS[-1]
    # a kernel's own ceiling bounds the race (bf16_tiles stops at 512 rows, amx_linear at 1,024)
    limit, _, record = linear_race.race_tile_rows([("model.layers.0.mlp.down_proj", _fake_layer(512))])
    assert limit == 512 and record[-1]["rows"] == 512
    monkeypatch.setattr(linear_race, "_time", fake_time(lambda rows: 0.03))
    assert linear_race.race_tile_rows(layers)[0] == linear_race.ALWAYS_OURS  # lost at once: decodes only
    slow = lambda rows: 0.2 if rows == 16 else 0.01  # noqa: E731
    monkeypatch.setattr(linear_race, "_time", lambda ls, xs, tile, repeats: slow(16) if tile else 0.3)
    limit, _, record = linear_race.race_tile_rows(layers)
    assert limit == 16 and record[1:] == [{"rows": 16, "ours_ms": 200.0, "onednn_ms": 300.0}]


def test_a_loss_must_hold_when_timed_again(monkeypatch):
    """One slow timing of ours (the host busy for a moment) at 32 rows does not end the race there; a loss that
    holds over every re-timing does, and both paths were timed that many times more."""
    from pagedllm.models.layers import linear_race

    fake = _fake_layer(512)
    calls = []

    def noisy(ls, xs, tile, repeats):
        rows = next(iter(xs.values())).shape[0]
        calls.append((rows, tile))
        if not tile:
            return 0.02
        return 0.05 if (rows == 32 and calls.count((32, True)) == 1) or rows == 128 else 0.01

    monkeypatch.setattr(linear_race, "_time", noisy)
    limit, _, record = linear_race.race_tile_rows([("model.layers.0.mlp.down_proj", fake)])
    assert limit == 64 and [r["rows"] for r in record[1:]] == [16, 32, 64, 128]
    assert record[2] == {"rows": 32, "ours_ms": 10.0, "onednn_ms": 20.0}  # the best of its timings
    assert calls.count((32, True)) == 2 and calls.count((128, True)) == calls.count((128, False)) == \
        1 + linear_race.LOSS_RETIMES


@pytest.mark.parametrize("faster", [True, False])
def test_the_race_keeps_the_faster_prefetch_setting(monkeypatch, faster):
    """Our kernel's software prefetch is timed on and off first (8 and 16 rows); the faster setting is what every
    layer keeps, and what the row race then times."""
    from pagedllm.models.layers import linear_race

    fake = _fake_layer(512, prefetch=None)
    seen = []

    def fake_time(ls, xs, tile, repeats):
        if not tile:  # the row race's oneDNN side: ours was just timed with the setting the race kept
            seen.append(ls[0].prefetch)
        return (0.01 if ls[0].prefetch == faster else 0.02) if tile else 0.005
    monkeypatch.setattr(linear_race, "_time", fake_time)
    limit, prefetch, record = linear_race.race_tile_rows([("model.layers.0.mlp.down_proj", fake)])
    # lost at 16 rows (timed again before it stood), with the setting kept
    assert prefetch is faster and fake.prefetch is faster and seen == [faster] * (1 + linear_race.LOSS_RETIMES)
    assert record[0]["rows"] == linear_race.PREFETCH_RACE_ROWS and limit == linear_race.ALWAYS_OURS
    assert record[0]["prefetch_ms" if faster else "no_prefetch_ms"] < record[0][
        "no_prefetch_ms" if faster else "prefetch_ms"]


def test_pack_linears_gives_every_tiled_layer_the_raced_limit():
    from pagedllm.models.layers import linear_race
    from pagedllm.models.layers.packed_linear import pack_linears

    _kernel("bf16_tiles")
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256), nn.Linear(256, 512), nn.Linear(512, 256))
    model = model.to(torch.bfloat16)
    assert pack_linears(model, use_amx=False) == 4
    limits = {(m.max_tile_rows, m.prefetch) for m in model.modules() if isinstance(m, PackedLinear)}
    assert len(limits) == 1 and {r for r, _ in limits} <= {linear_race.ALWAYS_OURS, *linear_race.RACE_ROWS}


def test_the_race_stops_at_the_layers_own_ceiling(monkeypatch):
    from pagedllm.models.layers import linear_race

    fake = _fake_layer(64)
    monkeypatch.setattr(linear_race, "_time", lambda ls, xs, tile, repeats: 0.01 if tile else 0.02)
    limit, _, record = linear_race.race_tile_rows([("model.layers.0.mlp.down_proj", fake)])
    assert limit == 64 and [r["rows"] for r in record[1:]] == [16, 32, 64]


def test_a_kernel_without_a_prefetch_switch_races_rows_only(monkeypatch):
    """The AMX kernel has no software prefetch to switch: no prefetch race, the rows raced from 16 on."""
    from pagedllm.models.layers import linear_race

    fake = _fake_layer(linear_race.RACE_ROWS[-1], prefetch_switch=False, prefetch=True)
    timed = []
    monkeypatch.setattr(linear_race, "_time", lambda ls, xs, tile, repeats: timed.append(
        next(iter(xs.values())).shape[0]) or (0.01 if tile else 0.02))
    limit, prefetch, record = linear_race.race_tile_rows([("model.layers.0.mlp.down_proj", fake)])
    assert limit == linear_race.RACE_ROWS[-1] and prefetch
    assert [r["rows"] for r in record] == list(linear_race.RACE_ROWS)
    assert min(timed) == linear_race.RACE_ROWS[0]  # nothing timed at the prefetch race's 8 rows


def test_pack_linears_takes_the_amx_kernel_where_it_packs_the_weight():
    """On an AMX host: the AMX tiles for weights whose dimensions are multiples of 32, the AVX512-BF16 tiles for
    the others (both raced to one limit); with use_amx=False, the AVX512-BF16 tiles for all."""
    from pagedllm.models.layers.packed_linear import pack_linears

    amx, tiles = _kernel("amx_linear"), _kernel("bf16_tiles")
    for use_amx in (True, False):
        model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 48)).to(torch.bfloat16)
        assert pack_linears(model, use_amx=use_amx) == 2
        assert [model[0].tiles_kernel, model[1].tiles_kernel] == [amx if use_amx else tiles, tiles]
        assert model[0].max_tile_rows == model[1].max_tile_rows
        with torch.inference_mode():
            x = torch.randn(3, 256, dtype=torch.bfloat16)
            first = model[0]
            assert torch.equal(first(x), first.tiles_kernel.linear(x, first.weight_tiles, first.bias_f32))
