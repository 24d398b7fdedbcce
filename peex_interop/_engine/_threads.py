"""Per-thread state: hooking is visible to the thread that hooks only.

A hooked call may run while other threads call the same layers unhooked (or hooked
with other hooks): every piece of state that says what is running now is a
`ThreadStack`, one list per thread.
"""

import threading


class ThreadStack(threading.local):
    """A list per thread (`threading.local` runs `__init__` once in each thread)."""

    def __init__(self):
        self.items: list = []

