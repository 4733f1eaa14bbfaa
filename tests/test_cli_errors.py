"""Every `gen` command answers a malformed shape, model or config with one line on stderr that names
the problem, exit status 2 and no traceback, before it looks for a GPU or compiles anything."""
import json

import pytest

from gen.cli import main


@pytest.fixture
def null_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": None, "intermediate_size": 11008, "num_attention_heads": 32}))
    return str(path)


CASES = [
    (["tune", "--shapes", "4096x100", "--dry-run"],
     "gen tune: layer 4096x100 (4096x100): N=100 must be a multiple of 64"),
    (["tune", "--shapes", "4096x4096", "--group", "32", "--dry-run"],
     "gen tune: layer 4096x4096 (4096x4096): group size 32 with K=4096 cannot run"),
    (["tune", "--shapes", "4096"], "gen tune: bad shape '4096': expected KxN"),
    (["tune", "--shapes", "axb"], "gen tune: bad shape 'axb': expected KxN"),
    (["tune", "--model", "nonexistent"], "gen tune: unknown model 'nonexistent'"),
    (["tune", "--model", "{config}"], "gen tune: model config: hidden_size is null"),
    (["sweep", "--family", "stream_mma", "--shapes", "4096x100"], "gen sweep: layer 4096x100 (4096x100): N=100"),
    (["precompile", "--shapes", "4096x100", "--arch", "sm_90a", "--dry-run"], "gen precompile: layer 4096x100"),
    (["precompile", "--model", "{config}", "--arch", "sm_90a", "--dry-run"],
     "gen precompile: model config: hidden_size is null"),
    (["bench", "--shapes", "4096x100"], "gen bench: layer 4096x100 (4096x100): N=100 must be a multiple of 64"),
    (["bench", "--shapes", "4096"], "gen bench: bad shape '4096'"),
    (["bench", "--model", "nonexistent"], "gen bench: unknown model 'nonexistent'"),
    (["bench", "--model", "{config}"], "gen bench: model config: hidden_size is null"),
    (["bench", "--group", "32"], "gen bench: layer qkv_proj (4096x12288): group size 32 with K=4096 cannot run"),
    (["compile", "--shape", "4096"], "gen compile: bad shape '4096'"),
    (["compile", "--shape", "4096x100"], "gen compile: N=100 must be a multiple of 64"),
    (["compile", "--shape", "4096x4096,4096x4096"], "gen compile: --shape takes one KxN"),
    (["compile", "--shape", "4096x4096", "--group", "32"], "gen compile: group size 32 with K=4096 cannot run"),
    (["compile", "--shape", "4096x4096", "--arch", "sm_70"], "gen compile: unknown arch 'sm_70'"),
    (["compile", "--shape", "4096x4096", "--knobs", "nope=1"], "gen compile: bad knob 'nope=1'"),
    (["profile", "--shape", "4096x100", "--m", "1"], "gen profile: N=100 must be a multiple of 64"),
    (["timeline", "--shape", "axb", "--m", "1"], "gen timeline: bad shape 'axb'"),
    (["timeline", "--shape", "4096x100", "--m", "1"], "gen timeline: N=100 must be a multiple of 64"),
    (["tune", "--shapes", "4096x4096", "--group", "0", "--dry-run"],
     "gen tune: layer 4096x4096 (4096x4096): group size 0: a group holds a positive number of input rows"),
    (["tune", "--model", "llama-2-7b", "--act", "fp8", "--dry-run", "--arch", "sm_80"],
     "gen tune: --act fp8 (W4A8) runs on FP8 wgmma, sm_90a; sm_80 has none"),
    (["precompile", "--model", "llama-2-7b", "--act", "fp8", "--arch", "sm_80", "--dry-run"],
     "gen precompile: --act fp8 (W4A8) runs on FP8 wgmma, sm_90a; sm_80 has none"),
    (["precompile", "--shapes", "64x64", "--group", "64", "--arch", "sm_80", "--dry-run"],
     "gen precompile: no schedule can run n64_k64_cw_float16_w4 on sm_80"),
    (["precompile", "--checkpoint", "/nonexistent/folder", "--arch", "sm_90a", "--dry-run"],
     "gen precompile: /nonexistent/folder: no such folder"),
    (["precompile", "--shapes", "4096x4096", "--arch", "sm_80", "--gpu", "nvidia-h200_sm_90a_132sm", "--dry-run"],
     "gen precompile: the tuned table 'nvidia-h200_sm_90a_132sm' is for sm_90a, not --arch sm_80"),
    (["compile", "--shape", "4096x4096", "--family", "nosuch"], "gen compile: unknown schedule family 'nosuch'"),
    (["compile", "--shape", "4096x4096", "--family", "stream_wgmma", "--arch", "sm_80"],
     "gen compile: no stream_wgmma schedule can run n4096_k4096_g128_float16_w4 on sm_80"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_a_malformed_shape_model_or_config_is_one_line_naming_it(capsys, tmp_path, monkeypatch, null_config,
                                                                  argv, message):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path / "cache"))
    rc = main([a.replace("{config}", null_config) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(message) and "\n" not in err, err
    assert not (tmp_path / "cache").exists()           # refused before anything was built or written


@pytest.mark.parametrize("command", [["tune", "--shapes", "4096x4096"], ["sweep", "--family", "stream_mma"],
                                     ["precompile", "--shapes", "4096x4096"]])
@pytest.mark.parametrize("workers", ["0", "-1", "x"])
def test_workers_must_be_a_positive_number(capsys, command, workers):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--workers", workers])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "--workers: takes a positive number of processes" in err and "\n" not in err


@pytest.mark.parametrize("argv, message", [(["bench", "--rounds", "0"], "gen bench: argument --rounds"),
                                           (["tune", "--no-such-flag"], "gen: unrecognized arguments: --no-such-flag"),
                                           (["compile"], "gen compile: the following arguments are required: --shape")])
def test_a_malformed_or_missing_flag_is_one_line_naming_it(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith(message) and err.endswith("--help)") and "\n" not in err, err


def test_act_takes_what_a_layer_can_ask_for(capsys):
    """fp8_rounded is what the op runs some W4A8 buckets as (on the W4A16 twin's tuned entries), not
    activations a layer, and so a tune, can ask for."""
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--shapes", "4096x4096", "--act", "fp8_rounded", "--dry-run"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'fp8_rounded'" in err
