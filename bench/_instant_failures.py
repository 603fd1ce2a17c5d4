"""A pytest plugin (``-p bench._instant_failures``) that prints each failure's traceback as soon as the test
fails, not in the summary at the end: a GPU run cut by its time limit still says why its tests failed."""

from __future__ import annotations

import pytest

_RUN: dict[str, pytest.Config] = {}  # this pytest run's config (one run per process), for the hook below


def pytest_configure(config: pytest.Config) -> None:
    _RUN["config"] = config


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed:
        return
    text = f"\n--- {report.nodeid} failed in {report.when}:\n{report.longreprtext}\n--- end of {report.nodeid}"
    config = _RUN.get("config")
    writer = config.pluginmanager.get_plugin("terminalreporter") if config is not None else None
    if writer is not None:
        writer.write_line(text)
    else:  # no terminal reporter (-p no:terminal): stdout still reaches the log
        print(text, flush=True)
