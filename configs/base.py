"""Where a config file starts: ``base.get_config()`` returns every field at its default.

The defaults and what each field means live in the library,
``oodjax.config_fields`` (`python -m oodjax.main --help` lists them); a
config file changes some of them and returns the config.
"""

from oodjax.config_fields import get_config

__all__ = ["get_config"]
