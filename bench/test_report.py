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


def point(system, rep, iops, cpu, label="4K randread, 1 x QD32"):
    return {"experiment": "frontends", "system": system, "iops": iops, "server_cpu_us_per_io": cpu,
            "params": {"rw": "randread", "connections": 1, "qd": 32, "pinned": False, "rep": rep, "point": label}}


class FrontendPairs(unittest.TestCase):
    def test_each_repetition_pairs_nvme_with_nbd(self):
        points = [point("NBD", 0, 100.0, 2.0), point("NVMe/TCP", 0, 90.0, 2.2), point("BRP (adaptive)", 0, 300.0, 1.0),
                  point("NVMe/TCP", 1, 110.0, 1.8), point("NBD", 1, 100.0, 2.0),
                  point("NBD", 2, 100.0, 2.0),  # NVMe/TCP failed this repetition: no pair
                  {"experiment": "qd32", "system": "NBD", "iops": 1.0, "params": {"rep": 0}}]
        pairs = report.frontend_pairs(points)
        self.assertEqual(list(pairs), ["4K randread, 1 x QD32"])
        self.assertEqual([round(x, 3) for x in pairs["4K randread, 1 x QD32"]["iops"]], [0.9, 1.1])
        self.assertEqual([round(x, 3) for x in pairs["4K randread, 1 x QD32"]["cpu"]], [1.1, 0.9])
        text = report.pairs_text(pairs)
        self.assertIn("| 4K randread, 1 x QD32 | 0.90 1.10 | 1.10 0.90 |", text)
        self.assertIn("All 2 pairs, NVMe/TCP over NBD: median IOPS 1.000x (from 0.90x to 1.10x)", text)

    def test_older_runs_without_the_label_and_runs_without_the_point(self):
        p = point("NBD", 0, 100.0, 2.0)
        q = point("NVMe/TCP", 0, 97.0, 2.1)
        for e in (p, q):
            del e["params"]["point"]
            e["params"]["pinned"] = True
        self.assertEqual(list(report.frontend_pairs([p, q])), ["4K randread, 1 x QD32, pinned apart"])
        self.assertEqual(report.frontend_pairs([]), {})
        self.assertEqual(report.pairs_text({}), "")


class Durability(unittest.TestCase):
    def test_flush_latency_and_the_ratio_to_nbdkit(self):
        point = "4K randwrite, a FLUSH every 4 writes, 4 x QD16"
        r = {"durability": {point: {"fastsan": {"iops": 30000.0, "flush_lat_mean_us": 1600.0, "server_cpu_us_per_io": 9.5},
                                    "nbdkit": {"iops": 20000.0, "flush_lat_mean_us": 2500.0, "server_cpu_us_per_io": 12.0}}}}
        text = report.durability_table(r)
        self.assertIn(f"| {point} | fastsan | 30 K | 1600 | 9.50 |", text)
        self.assertIn(f"| {point} | fastsan / nbdkit | 1.50x |  |  |", text)
        self.assertEqual(report.durability_table({}), "not measured\n")

    def test_direct_points_compare_with_qemu_nbd_and_the_device(self):
        point = "4K randread, 1 x QD32, O_DIRECT"
        r = {"durability": {point: {report.DIRECT: {"iops": 40000.0, "server_cpu_us_per_io": 20.0},
                                    report.DIRECT_PEER: {"iops": 32000.0, "server_cpu_us_per_io": 25.0},
                                    report.DEVICE: {"iops": 80000.0}}}}
        text = report.durability_table(r)
        self.assertIn(f"| {point} | {report.DIRECT} / {report.DIRECT_PEER} | 1.25x |  |  |", text)
        self.assertIn(f"| {point} | {report.DIRECT} / {report.DEVICE} | 0.50x |  |  |", text)
        self.assertIn(f"| {point} | {report.DEVICE} | 80 K | - | - |", text)
        self.assertNotIn("fastsan / nbdkit", text)


if __name__ == "__main__":
    unittest.main()
