"""A job: a config read once into its typed pieces (``oodjax.config_read``), then the sources it names checked
(``oodjax.config_checks``): what ``oodjax.main``, ``oodjax.evaluate`` and the launch tools take."""

from oodjax.config_checks import check_config as resolve
from oodjax.config_read import Job, read

__all__ = ["Job", "read", "resolve"]
