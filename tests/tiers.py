"""The test tiers (docs/testing.md): which tests are `slow`, and the flag that keeps a test
without the `distributed` marker from spawning ranks. Read by conftest.py and the harness."""

# The fast tier is `pytest -m "not distributed and not slow"`. `slow`: a test that spawns no
# ranks but takes several seconds on a 2-core CPU (over 5 s under load, where they took 5-55 s;
# 3-10 s on a quiet machine): an Inductor compile of the step, a Python subprocess that imports
# torch (and transformers or torchtitan), a training run of the demo; and one module, the Triton
# kernels through the interpreter in a worker subprocess (1-6 s each, 80 s together under load).
# By file: the tests' names (every parametrisation), or "*" for the whole file;
# tests/test_tiers.py checks that each entry exists.
SLOW = {
    "tests/kernels/test_syrk_interpret.py": ["*"],
    "tests/test_layouts_blocked.py": ["test_compiled_step_equals_eager_with_blocked_layouts"],
    "tests/benchmarks/test_bench_peers.py": [
        "test_peer_step_is_an_orthogonalised_update_per_matrix_and_expert",
        "test_peer_runs_model_tiny_e_on_cpu",
        "test_dion_missing_names_the_wheel_and_the_others_run",
    ],
    "tests/passes/test_compiled_step.py": [
        "test_compiled_step_equals_eager_step",
        "test_pass_fires_in_inductor_direct_2d_bf16_and_wraps_user_pass",
        "test_lr_schedule_never_recompiles_and_no_graph_breaks",
        "test_user_compiled_opt_step_gets_the_same_rewrite",
        "test_pass_fires_in_inductor_gram_3d_fp16",
        "test_explicit_cublas_kernel_keeps_the_plain_chain_in_the_compiled_step",
    ],
    "tests/passes/test_pass_logging.py": [
        "test_torch_logs_module_name_works_from_the_environment",
        "test_torch_logs_plus_dmuon_works_through_the_torch_backends_entry_point",
    ],
    "tests/passes/test_ns_rewrite.py": [
        "test_gram_chain_fully_rewritten",
        "test_provenance_polynomial_is_the_composed_ns_polynomial",
        "test_rewritten_graph_equals_original",
    ],
    "tests/test_deferred_verdict.py": ["test_the_flags_and_the_normalisation_share_one_norm"],
    "tests/test_momentum_dtype.py": ["test_the_compiled_step_equals_the_eager_one"],
    "tests/test_momentum_streaming_compiled.py": ["*"],
    "tests/test_normuon.py": ["test_the_compiled_step_equals_the_eager_one"],
    "tests/test_head_layouts.py": [
        "test_the_real_transformers_llama_attention_is_recognised",
        "test_the_real_transformers_deepseek_v3_attention_is_recognised",
        "test_the_real_transformers_gpt_oss_is_recognised",
    ],
    "tests/integrations/test_torchtitan_config_options.py": [
        "test_momentum_dtype_and_per_head_reach_muon"
    ],
    "tests/test_import.py": [
        "test_accelerate_integration_without_accelerate_names_the_extra",
        "test_import_never_imports_the_integrations_frameworks",
        "test_subpackages_import_only_under_the_package_name",
    ],
    "tests/test_import_cost.py": [
        "test_plain_import_torch_imports_nothing_of_the_package",
        "test_control_old_entry_point_imports_the_package",
        "test_torch_logs_plus_dmuon_from_the_environment",
        "test_import_dmuon_compile_loads_no_compiler_stack",
        "test_control_the_eager_import_loads_the_compiler_stack",
    ],
    "tests/test_root_imports.py": ["test_transformers_imports_from_the_root"],
    "tests/test_user_compiled_step.py": ["test_control_one_cycle_float_momentum_recompiles"],
    "tests/train/test_run.py": [
        "test_save_every_and_resume_continue_the_run",
        "test_single_process_prints_the_breakdown",
    ],
    "tests/train/test_precision.py": ["test_compiled_blocks_train_like_eager"],
    "tests/integrations/test_torchtitan.py": [
        "test_import_error_names_the_extra_and_core_import_stays_free_of_torchtitan"
    ],
}


def is_slow(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (``path::name[params]``) is in :data:`SLOW`."""
    path, _, name = nodeid.partition("::")
    names = SLOW.get(path, ())
    return "*" in names or name.split("[", 1)[0] in names


# Set (to the test's node id) by conftest.py while a test without the `distributed` marker runs:
# the harness then refuses to spawn ranks (the fast tier deselects by that marker alone).
NOT_DISTRIBUTED_ENV = "DMUON_TEST_NOT_DISTRIBUTED"
