"""A pure-Python counter thread: how fast it counts while something else runs
says how much of the GIL that something leaves to other threads.  Used by
bench_serving.py and by peer_worker.py (inside the llama-cpp-python venv)."""
import threading
import time


class Counter:
    """``with Counter() as c: work()`` then ``c.rate`` (counts per second)."""

    def __enter__(self):
        self._stop = threading.Event()
        self.count = 0
        self._t = threading.Thread(target=self._run)
        self._t0 = time.perf_counter()
        self._t.start()
        return self

    def _run(self):
        n = 0
        stop = self._stop
        while not stop.is_set():
            n += 1
        self.count = n

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.seconds = time.perf_counter() - self._t0
        self.rate = self.count / self.seconds


def solo_rate(seconds: float = 0.5) -> float:
    with Counter() as c:
        time.sleep(seconds)
    return c.rate
