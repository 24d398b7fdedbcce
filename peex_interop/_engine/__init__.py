"""The engine: hooking contexts, call sites and their selection, layer paths, scoped
patching, the threaded transforms, and the library-neutral parameter layouts. It knows
no model library: each adapter hands it its layer calls (`call_site`) and registers
what its library needs (patches, shape-pass savers, native hooks)."""

from ._arguments import pre_hook_inputs as pre_hook_inputs
from ._batching import per_example as per_example
from ._bindings import bindings as bindings
from ._context import (
    active as active,
    call_site as call_site,
    name_returned as name_returned,
    origin as origin,
    refuse_if_passed_through as refuse_if_passed_through,
)
from ._declarations import (
    NO_DECLARATIONS as NO_DECLARATIONS,
    Declarations as Declarations,
    Declared as Declared,
    StoredParam as StoredParam,
    as_stored as as_stored,
    at as at,
    declare as declare,
)
from ._function_sites import (
    FunctionSites as FunctionSites,
    function_sites as function_sites,
)
from ._hook_context import HookContext as HookContext
from ._hooking import Native as Native, hooking as hooking, register_native as register_native
from ._inner_sites import (
    WEIGHTS as WEIGHTS,
    ModuleView as ModuleView,
    attention_sites_wanted as attention_sites_wanted,
    inner_site as inner_site,
    running_layer as running_layer,
    silenced as silenced,
)
from ._jax import TANGENT_SURVIVES_CUSTOM_VJP_IN_SCAN as TANGENT_SURVIVES_CUSTOM_VJP_IN_SCAN, BatchTracer as BatchTracer
from ._kinds import (
    INNER_KINDS as INNER_KINDS,
    KINDS as KINDS,
    MEMBERS as MEMBERS,
    METHOD as METHOD,
    PERTURBATION as PERTURBATION,
    SOWN as SOWN,
    kind_of as kind_of,
)
from ._known_paths import inner_site_names as inner_site_names
from ._layouts import (
    AS_STORED as AS_STORED,
    Container as Container,
    Layout as Layout,
    Param as Param,
    axes as axes,
    context_mesh as context_mesh,
    fit as fit,
    fit_state as fit_state,
    is_abstract as is_abstract,
    is_inexact as is_inexact,
    lax_transpose_padding as lax_transpose_padding,
    member_axis as member_axis,
    member_of as member_of,
    merged_members as merged_members,
    placed as placed,
    put_like as put_like,
    refuse as refuse,
    refuse_reparametrised as refuse_reparametrised,
    refuse_unread as refuse_unread,
)
from ._methods import (
    known_method_paths as known_method_paths,
    method_call_patches as method_call_patches,
    site_methods as site_methods,
)
from ._patching import (
    ORIGINAL as ORIGINAL,
    call_patches as call_patches,
    defines as defines,
    entry_point as entry_point,
    method_patches as method_patches,
    patched as patched,
    unwrap as unwrap,
)
from ._paths import (
    AbstractConverted as AbstractConverted,
    AbstractTransparent as AbstractTransparent,
    check_model as check_model,
    children as children,
    float_size as float_size,
    join as join,
    key_name as key_name,
    known_module_paths as known_module_paths,
    module_paths as module_paths,
    walk as walk,
)
from ._pooling import (
    AbstractPooled as AbstractPooled,
    is_pooled as is_pooled,
    mapped_vmaps as mapped_vmaps,
    pool_log as pool_log,
)
from ._routes import register_weights_function as register_weights_function
from ._selection import (
    EVERY_SITE as EVERY_SITE,
    Criterion as Criterion,
    Kind as Kind,
    Selection as Selection,
    Where as Where,
    all_of as all_of,
    glob_to_regex as glob_to_regex,
    kind as kind,
    may_name_a_step as may_name_a_step,
    not_ as not_,
    step_path as step_path,
)
from ._shape_pass import (
    register_shape_pass_save as register_shape_pass_save,
    shape_only as shape_only,
    snapshot_containers as snapshot_containers,
)
from ._shapes import check_same_shape as check_same_shape, zeros_like as zeros_like
from ._sites import (
    CallSite as CallSite,
    InnerCall as InnerCall,
    Site as Site,
    call_with_site as call_with_site,
    needs_indices as needs_indices,
    takes_site as takes_site,
)
from ._sown import sown_patches as sown_patches
from ._threads import ThreadStack as ThreadStack
