"""benchmarks/timing.py's reading of nvidia-smi's power-capping counter (the rest of timing.py needs a
GPU and runs in the benchmarks on the device)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from timing import parse_power_capped_us  # noqa: E402

# `nvidia-smi -q -d PERFORMANCE` on an H100 80GB HBM3 (driver of the device image, 2026-12-07), after
# back-to-back MoE calls at T=16384
SMI_AFTER_MOE = """
==============NVSMI LOG==============

Attached GPUs                                          : 1
GPU 00000000:18:00.0
    Performance State                                  : P0
    Clocks Event Reasons
        Idle                                           : Active
        Applications Clocks Setting                    : Not Active
        SW Power Cap                                   : Not Active
        HW Slowdown                                    : Not Active
            HW Thermal Slowdown                        : Not Active
            HW Power Brake Slowdown                    : Not Active
        Sync Boost                                     : Not Active
        SW Thermal Slowdown                            : Not Active
        Display Clock Setting                          : Not Active
    Clocks Event Reasons Counters
        SW Power Capping                               : 6492582 us
        Sync Boost                                     : 0 us
        SW Thermal Slowdown                            : 0 us
        HW Thermal Slowdown                            : 0 us
        HW Power Braking                               : 0 us
    Sparse Operation Mode                              : Disabled
"""


def test_the_counter_is_read_not_the_state_line():
    # "SW Power Cap : Not Active" (the state) precedes "SW Power Capping : N us" (the counter)
    assert parse_power_capped_us(SMI_AFTER_MOE) == 6492582


def test_no_counter_gives_none():
    without = "\n".join(line for line in SMI_AFTER_MOE.splitlines() if "Capping" not in line)
    assert parse_power_capped_us(without) is None
    assert parse_power_capped_us("") is None

