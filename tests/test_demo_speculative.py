"""``python -m hcache demo --speculative``: it runs clean (every token and its logits equal the
non-speculative uncached greedy run, some drafts accepted and some rejected), and its exactness
check fails when a draft commit is broken (the accepted state not scattered, the bonus token not
counted)."""

from __future__ import annotations

import re

import pytest

import hcache.ops
from hcache.__main__ import main
from hcache.demo import speculative

import helpers


@pytest.mark.parametrize("device", helpers.DEVICES)
def test_speculative_demo_runs_clean(device, capsys):
    assert speculative.run_speculative_demo(device=device) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out
    rate = int(re.search(r"accepted rate (\d+)%", out).group(1))
    assert 0 < rate < 100        # both accepts and rejections happened
    accepted = [list(map(int, m.split(", ")))
                for m in re.findall(r"accepted \[([\d, ]+)\] of 3", out)]
    flat = [a for step in accepted for a in step]
    assert 0 in flat and 3 in flat and any(0 < a < 3 for a in flat)
    assert out.strip().splitlines()[-1].startswith("demo --speculative: all ")


def test_cli_flag_runs_the_speculative_demo(capsys):
    assert main(["demo", "--device", "cpu", "--speculative"]) == 0
    assert "demo --speculative: all" in capsys.readouterr().out


def test_a_commit_that_drops_the_state_scatter_is_caught(monkeypatch, capsys):
    monkeypatch.setattr(hcache.slots.drafts.ops, "draft_accept", lambda *a, **k: None)
    assert speculative.run_speculative_demo(device="cpu") == 1
    assert "MISMATCH speculative" in capsys.readouterr().out


def test_a_commit_that_forgets_the_bonus_token_is_caught(monkeypatch, capsys):
    real = hcache.ops.draft_lengths

    def no_bonus(*args, bonus=0, **kwargs):
        return real(*args, bonus=0, **kwargs)

    monkeypatch.setattr(hcache.slots.drafts.ops, "draft_lengths", no_bonus)
    assert speculative.run_speculative_demo(device="cpu") == 1
    assert "MISMATCH speculative" in capsys.readouterr().out


@pytest.mark.emulated
def test_speculative_demo_on_the_emulated_device(emu_rt, capsys):
    """The CUDA path (device arrays, queued launches, the real kernels): still exact."""
    assert speculative.run_speculative_demo(device="cuda") == 0
    assert "MISMATCH" not in capsys.readouterr().out
