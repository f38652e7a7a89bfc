"""The report's machine line: the idle policy a run recorded (bench/report.py)."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402


class IdlePolicy(unittest.TestCase):
    def test_halt_polling_off_on_and_set_for_the_run(self):
        off = {"idle": {"cpuidle": "haltpoll", "halt_poll_ns": 0, "set_for_run": False}}
        self.assertEqual(report.idle_text(off), "; idle vCPUs: cpuidle haltpoll, guest halt polling off")
        on = {"idle": {"cpuidle": "haltpoll", "halt_poll_ns": 200000, "set_for_run": True}}
        self.assertEqual(report.idle_text(on),
                         "; idle vCPUs: cpuidle haltpoll, guest halt polling on, 200 us (set for this run)")

    def test_other_drivers_and_runs_that_did_not_record_it(self):
        self.assertEqual(report.idle_text({"idle": {"cpuidle": "intel_idle", "halt_poll_ns": None}}),
                         "; idle CPUs: cpuidle intel_idle")
        self.assertEqual(report.idle_text({"nproc": 2}), "")
        self.assertEqual(report.idle_text({"idle": {"cpuidle": None, "halt_poll_ns": None}}), "")


if __name__ == "__main__":
    unittest.main()
