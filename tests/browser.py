"""A headless Chromium for the monitor's page tests: Debian's ``chromium`` and ``chromium-driver``
(.ci/run installs them), driven by selenium, started once per session (tests/monitor/conftest.py).

This machine has no internet: without the flags below Chromium tries to reach Google's services
and hangs on the refused connections.
"""

from __future__ import annotations

import os
import shutil
import tempfile

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1440,900")


class Browser:
    """A selenium driver of a headless Chromium with a fresh profile (removed by :meth:`quit`)."""

    def __init__(self) -> None:
        missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(path)]
        if missing:
            raise RuntimeError(f"the monitor's page tests need Debian's chromium and chromium-driver ({missing} "
                               "missing): apt-get install -y chromium chromium-driver (.ci/run does)")
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="rlh-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in FLAGS + (f"--user-data-dir={self.profile}",):
            options.add_argument(flag)
        self.service = Service(CHROMEDRIVER)
        try:
            self.driver = webdriver.Chrome(service=self.service, options=options)
        except BaseException:
            shutil.rmtree(self.profile, ignore_errors=True)
            raise
        self.driver.set_page_load_timeout(30)
        self.driver.set_script_timeout(10)

    def quit(self) -> None:
        try:
            self.driver.quit()
        finally:
            self.service.stop()
            shutil.rmtree(self.profile, ignore_errors=True)
