"""A fake CUDA event for the timer's tests (CPU): it reads a clock the test advances."""


class FakeEvent:
    """``torch.cuda.Event`` as the timer uses it: ``record`` reads ``clock[0]`` (ms),
    ``elapsed_time`` is the difference of two recorded readings."""

    def __init__(self, clock: list):
        self.clock = clock

    def record(self):
        self.t = self.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t
