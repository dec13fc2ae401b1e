#!/usr/bin/env bash
# Debian's Chromium and ChromeDriver for the demo page's browser test. Installs them when missing and we are
# root (CI, fresh machines); otherwise says how, and the browser test skips (or fails under CI).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium and chromium-driver for the browser test"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
else
    echo "note: chromium and chromedriver are missing; install Debian's chromium and chromium-driver" \
         "to run the demo page's browser test (it is skipped without them)"
fi
