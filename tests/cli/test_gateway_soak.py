"""The gateway soak (bench/gateway_soak.py) run briefly: it samples what it reports, its load does what it
says (sessions, forks, refused unknown fields, slow clients closed by the server), and each run it deletes
takes what its finished sessions stored out of Redis."""

from __future__ import annotations

from bench import gateway_soak


def test_a_short_soak_samples_and_releases() -> None:
    r = gateway_soak.run(minutes=0.3, open_sessions=40, slow=4, warmup_s=3.0, run_s=6.0, sample_s=1.0,
                         think_s=0.2)
    counts = r["counts"]
    assert counts["unexpected"] == {}, counts
    assert counts["sessions"] >= 40 and counts["turns"] >= 3 * counts["sessions"] - 40
    assert counts["forks"] > 0 and counts["refused_unknown"] > 0
    assert counts["slow_closed_by_server"] > 0, "the server's header timeout closed no slow client"
    assert counts["groups_read"] >= counts["sessions"] - 40
    samples = r["samples"]
    assert len(samples) >= 8
    assert all(s["api_rss_mb"] > 10 and s["redis_used_mb"] > 0 and s["metrics_kb"] > 1 for s in samples)
    for key in ("api_rss_mb", "redis_used_mb", "metrics_kb"):
        series = r["series"][key]
        assert series["first_quarter"] > 0 and series["last_quarter"] > 0 and series["ratio"] > 0
    # retention: every run was deleted once its sessions finished and its groups were read, and with it
    # everything its sessions stored (turns, index) and every other key of the run but its tombstone
    released = r["released"]
    assert len(released) >= 2, released
    assert all(run["session_bytes_before"] > 0 and run["keys_left"] == [] for run in released), released
    assert r["redis_used_mb_after_all_deleted"] < max(s["redis_used_mb"] for s in samples)
