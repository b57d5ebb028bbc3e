"""Property tests: report how many generated cases ran, over all of them, at the end of the run."""

import re

_PASSING = re.compile(r"(\d+) passing")


def pytest_terminal_summary(terminalreporter):
    # hypothesis' pytest plugin leaves each test's statistics text on its teardown report
    cases = tests = 0
    for reports in terminalreporter.stats.values():
        for report in reports:
            stats = getattr(report, "__dict__", {}).get("_hypothesis_stats")
            if stats and "/property/" in f"/{report.nodeid}":
                tests += 1
                cases += sum(int(n) for n in _PASSING.findall(stats))
    if tests:
        terminalreporter.write_line(f"property tests: {cases} generated cases passed over {tests} tests")
