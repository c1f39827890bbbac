"""The bench's machine line says how idle CPUs wait (benchmarks/common.py ``idle_policy``): on a
VM the guest's halt polling changes a lockstep round trip's cost several-fold, so a table without
it cannot be compared with another."""

from __future__ import annotations

from benchmarks.common import idle_policy


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_idle_policy_reads_driver_governor_and_guest_halt_polling(tmp_path):
    _write(tmp_path / "cpuidle" / "current_driver", "haltpoll")
    _write(tmp_path / "cpuidle" / "current_governor", "haltpoll")
    _write(tmp_path / "ns", "0")
    text = idle_policy(str(tmp_path / "cpuidle"), str(tmp_path / "ns"))
    assert text == "cpuidle haltpoll/haltpoll, guest halt polling 0 ns (off)"
    _write(tmp_path / "ns", "200000")
    assert idle_policy(str(tmp_path / "cpuidle"), str(tmp_path / "ns")) == \
        "cpuidle haltpoll/haltpoll, guest halt polling 200000 ns"


def test_idle_policy_without_haltpoll_or_cpuidle(tmp_path):
    _write(tmp_path / "cpuidle" / "current_driver", "intel_idle")
    _write(tmp_path / "cpuidle" / "current_governor", "menu")
    assert idle_policy(str(tmp_path / "cpuidle"), str(tmp_path / "none")) == "cpuidle intel_idle/menu"
    assert idle_policy(str(tmp_path / "absent"), str(tmp_path / "none")) == ""
