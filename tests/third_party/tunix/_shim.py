# Copyright 2025 Google LLC (tunix/utils/compat.py, tunix/utils/env_utils.py)
# Copyright 2026 Google LLC (tunix/utils/sharding_utils.py)
# (tunix/generate/mappings.py, the source of BackendMappingMixin, has no header.)
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""The parts of tunix outside `tunix/models` that the vendored model files use.

Not part of tunix: written for this vendored copy (see README.md). Each name below
is copied from google-tunix 0.1.7, unchanged, from the file named above it, and
exposed under the module name the model files import it as (`compat`, `env_utils`,
`sharding_utils`), so that each model file's only edit is its import lines.
Only what the vendored files use is copied.
"""

from __future__ import annotations

import importlib
import types
from typing import Any, Dict, Tuple

import flax
from flax import nnx
import jax
from jax import numpy as jnp
from jax.interpreters import pxla
import jax.sharding as shd


# --- tunix/utils/compat.py (whole file) -----------------------------------------

# Flax version compatibility.
ModuleList = list

# To accomodate github requirements. nnx.List is available in flax 0.12.0 and
# later.
if hasattr(nnx, "List"):
  ModuleList = nnx.List  # noqa: N816 (public alias)


# JAX version compatibility
if hasattr(jax.sharding, "use_mesh"):
  set_mesh = jax.sharding.use_mesh
else:
  set_mesh = jax.set_mesh


# --- tunix/utils/env_utils.py (setup_sharding_environment only) -----------------


def setup_sharding_environment():
  """Sets up the sharding environment."""
  if hasattr(flax.config, 'flax_always_shard_variable'):
    flax.config.update('flax_always_shard_variable', False)


# --- tunix/utils/sharding_utils.py (whole file) ---------------------------------


# TODO(abheesht17): Use this function for all models and unify with the fn in
# sft/sharding_utils.py.
def shard(x: jnp.ndarray, s: Tuple[str, ...], eager: bool = False):
  """Shards a JAX array.

  Args:
    x: The JAX array to shard.
    s: The sharding spec.
    eager: If True, sharding is done eagerly via jax.device_put. Otherwise,
      sharding is done lazily via jax.lax.with_sharding_constraint.

  Returns:
    The sharded JAX array.
  """
  mesh = pxla.thread_resources.env.physical_mesh
  if mesh.empty or jax.devices()[0].platform == 'cpu':
    return jnp.asarray(x)
  sharding = shd.NamedSharding(mesh, shd.PartitionSpec(*s))
  if eager:
    return jax.device_put(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


# --- tunix/generate/mappings.py (BackendMappingMixin only) ----------------------


class BackendMappingMixin:
  """Provides helper methods to retrieve backend-specific weight mappings."""

  DEFAULT_BACKEND = 'vllm_jax'
  # Subclasses can override this to explicitly set the path
  BACKEND_PACKAGE_PATH = None

  @classmethod
  def _backend_registry(cls) -> Dict[str, Any]:
    # Use the explicit path if provided, otherwise fallback to the module path
    module = cls.BACKEND_PACKAGE_PATH or cls.__module__

    package_name = module.rsplit('.', 1)[0] if '.' in module else module
    package = importlib.import_module(package_name)

    return getattr(package, 'BACKEND_MAPPINGS', {})

  @classmethod
  def mapping_for(cls, backend: str | None = None) -> Dict[str, Any]:
    backend = backend or cls.DEFAULT_BACKEND
    registry = cls._backend_registry()
    if backend not in registry:
      raise RuntimeError(
          f'{backend} mappings not available for {cls.__name__}.'
      )
    return registry[backend]

  @classmethod
  def to_hf_mappings(cls, backend: str | None = None):
    mapping = cls.mapping_for(backend).get('to_hf_mappings')
    if mapping is None:
      raise RuntimeError(
          f'{backend} to_hf_mappings missing for {cls.__name__}.'
      )
    return mapping

  @classmethod
  def lora_to_hf_mappings(cls, backend: str | None = None):
    return cls.mapping_for(backend).get('lora_to_hf_mappings')

  @classmethod
  def to_hf_transpose_keys(cls, backend: str | None = None):
    result = cls.mapping_for(backend).get('to_hf_transpose_keys')
    return result or None

  @classmethod
  def lora_to_hf_transpose_keys(cls, backend: str | None = None):
    result = cls.mapping_for(backend).get('lora_to_hf_transpose_keys')
    return result or None

  @classmethod
  def to_hf_hook_fns(cls, backend: str | None = None):
    return cls.mapping_for(backend).get('to_hf_hook_fns')

  @classmethod
  def preprocess_src_state(cls, backend: str | None = None):
    return cls.mapping_for(backend).get('preprocess_src_state')


# --- the module names the model files import ------------------------------------

compat = types.SimpleNamespace(ModuleList=ModuleList, set_mesh=set_mesh)
env_utils = types.SimpleNamespace(
    setup_sharding_environment=setup_sharding_environment
)
sharding_utils = types.SimpleNamespace(shard=shard)
