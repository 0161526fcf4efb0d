"""A real browser for the tests and the page benchmark: headless Chromium loads a page, runs its
scripts, and hands back the DOM as the user would see it (or a screenshot).

Chromium comes from the system's packages: ``scripts/install.sh --test`` installs it where it can
(root with apt-get, as on CI); :func:`chromium` says what to do where it cannot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class NoBrowser(RuntimeError):
    pass


def chromium() -> str:
    """The path of a Chromium (or Chrome) binary; raises :class:`NoBrowser` saying how to get one."""
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    raise NoBrowser(
        "no Chromium on this machine: the page tests load /overlord in a real browser. Install it "
        "with `apt-get install chromium` (Debian; scripts/install.sh --test does that as root) or "
        "put a chromium/google-chrome binary on the PATH"
    )


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            chromium(),
            "--headless",
            "--no-sandbox",  # (CI runs as root, where Chromium's sandbox refuses to start)
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            *args,
        ]
        env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": "disabled:"}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def dom(url: str, *, wait_ms: int = 4000, timeout: float = 60) -> str:
    """The page's DOM after its scripts ran for ``wait_ms`` of virtual time (timers fire without
    waiting; the clock the page reads is virtual too)."""
    out = _run([f"--virtual-time-budget={wait_ms}", "--dump-dom", url], timeout)
    if out.returncode != 0 or "<html" not in out.stdout:
        raise RuntimeError(f"chromium could not load {url}: {out.stderr[-2000:]}")
    return out.stdout


def shown(page: str) -> str:
    """A dumped DOM without its scripts: what the page shows, not the code that drew it."""
    return re.sub(r"<script.*?</script>", "", page, flags=re.S)


def screenshot(url: str, path: str, *, width: int = 1280, height: int = 1500, wait_ms: int = 4000) -> str:
    """A PNG of the page as drawn after ``wait_ms`` of (virtual) time."""
    out = _run([f"--virtual-time-budget={wait_ms}", f"--window-size={width},{height}", f"--screenshot={path}", url], 60)
    if out.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"chromium could not take a screenshot of {url}: {out.stderr[-2000:]}")
    return path
