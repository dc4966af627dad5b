"""Typed run configuration: strict pydantic sections, YAML files, ``--set key=value`` overrides.

Every key of every section can be set from YAML or from the command line. Each key's bound sits on its field
(``fields.bound``), each rule between keys on the smallest section that holds them (``sections.py``), and whatever
does not fit reaches the person as one line that names the key and the fix: an unknown key, a section set as a value
or a value of the wrong type as the setting is read (``loading.settings_of``), a value out of bounds once the config
is built (``loading.built``). A peer that joins a run trains the run's config with its own settings on top
(``joining.py``).
"""

from p2ploco.config.fields import MAX_WAIT
from p2ploco.config.joining import batch_split, config_of_run, differences, split_for_run
from p2ploco.config.loading import keys_set, load_config, with_overrides
from p2ploco.config.sections import (
                                     LOCAL_KEYS,
                                     Config,
                                     DataConfig,
                                     DiLoCoConfig,
                                     InnerConfig,
                                     LoCoConfig,
                                     ModelConfig,
                                     OuterConfig,
                                     OverlapConfig,
                                     PipelineConfig,
                                     SparseLoCoConfig,
                                     StreamingConfig,
                                     SwarmConfig,
                                     TrainingConfig,
                                     document_fingerprint,
)

__all__ = ["LOCAL_KEYS", "MAX_WAIT", "Config", "DataConfig", "DiLoCoConfig", "InnerConfig", "LoCoConfig", "ModelConfig",
           "OuterConfig", "OverlapConfig", "PipelineConfig", "SparseLoCoConfig", "StreamingConfig", "SwarmConfig",
           "TrainingConfig", "batch_split", "config_of_run", "differences", "document_fingerprint", "keys_set",
           "load_config", "split_for_run", "with_overrides"]
