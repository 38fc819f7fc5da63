#!/usr/bin/env bash
# ci/chromium_up.sh - Debian's headless Chromium and its driver, for the monitor's page tests
# (tests/browser.py drives /usr/bin/chromium through /usr/bin/chromedriver with selenium).
# Idempotent: does nothing when both are installed; else apt-get (as root; `apt-get update` first
# when the package lists do not know chromium yet). ~40 s and ~100 MB on a fresh Debian 12 machine.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-cache show chromium-driver >/dev/null 2>&1; then
  apt-get update -qq
fi
apt-get install -y -qq chromium chromium-driver >/dev/null
/usr/bin/chromium --version
