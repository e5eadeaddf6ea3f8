"""Suite-wide setup.

A test runner started as a background job of a non-interactive shell (`cmd &`, as CI
scripts often do) inherits SIGINT ignored, and an ignored signal stays ignored across
exec: every daemon and CLI the tests spawn would then ignore the Ctrl-C that tests send
them (`kvctl watch` never exited; the demo ran to its end and exited 0). Restoring
Python's handler here gives the children SIGINT's default again (a handler, unlike
"ignored", is reset to the default on exec).
"""

from __future__ import annotations

import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
