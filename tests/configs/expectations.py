"""What each JSON file beside test_compat.py must do: train (None) or be refused before launch with a line containing
the text given; and which trainable files the slow runs leave out (each was trained by hand when its round added it).
"""
from __future__ import annotations

import importlib.util

# file -> None (trains) or the text its one-line refusal must contain
EXPECT: dict[str, str | None] = {
    "accelerate_zero2_no_optimizer.json": None,
    "activation_checkpointing_cpu.json": "activation_checkpointing.cpu_checkpointing:",
    "adam_max_grad_norm_param.json": "optimizer.params.max_grad_norm: gradient clipping is a top-level key, not an "
                                     "optimizer param (DeepSpeed refuses it by name at start-up); move it to the top "
                                     "level: \"gradient_clipping\": 1",
    "alignment_handbook_onebit_lamb.json": "optimizer.type: 'OneBitLamb': DeepSpeed 0.19 no longer has its 1-bit LAMB "
                                           "optimizer",
    "autotuning_section.json": "autotuning.enabled: dstrain does not run DeepSpeed's autotuner",
    "bf16_immediate_grad_update.json": None,
    "checkpoint_tag_validation_universal.json": None,
    "cifar_adagrad_optimizer.json": None,
    # round 11: "reduce_scatter_fn" is a wrapper DeepSpeed logs as "reduce_scatter_tensor": never profiled by that name
    "comms_logger_prof_ops_zero2.json": "comms_logger.prof_ops: 'reduce_scatter_fn' is not the name of an op "
                                        "DeepSpeed's comms logger logs",
    "compression_training_section.json": "top-level key 'compression_training' is no longer supported",
    "debug_memory_breakdown_dump_state.json": None,
    "elasticity_section.json": "top-level key 'elasticity' is no longer supported",
    "examples_lr_range_test.json": None,
    # Adam betas [0.9, 0.95] under OneCycle's momentum cycling (on by default), which writes beta2 0.99: a note
    "examples_onecycle_scheduler.json": None,
    "flops_profiler_detailed_stdout.json": None,
    "hf_fp16_auto_cast_hysteresis.json": None,
    "hf_warmup_decay_linear_all_auto.json": None,
    "legacy_zero2_cpu_offload_flag.json": None,
    # round 22: the fix no longer points at data_efficiency's curriculum, which dstrain refuses in turn
    "legacy_curriculum_learning_top_level.json": "top-level key 'curriculum_learning' is no longer supported: "
                                                 "DeepSpeed's curriculum moved to data_efficiency.data_sampling."
                                                 "curriculum_learning, which only DeepSpeed's own dataloader applies",
    "lion_optimizer_no_offload.json": "optimizer.type: 'Lion' runs DeepSpeed's FusedLion CUDA kernel, which the CPU "
                                      "accelerator does not have; use \"AdamW\" (or offload the optimizer",
    "megatron_prescale_gradients_zero1.json": None,
    "mics_zero3_shard_size.json": "zero_optimization.mics_hierarchical_params_gather, mics_shard_size: MiCS "
                                  "sharding was removed from DeepSpeed; remove them",
    "megatron_curriculum_data_efficiency.json": "data_efficiency.enabled: dstrain's samplers feed the data",
    "mixed_precision_typo_key.json": "unknown top-level key 'mixed_precision'",
    "seq_parallel_comm_dtype_bf16.json": None,
    "torch_autocast_bf16_section.json": None,
    "torch_autocast_fp16_on_cpu.json": "torch_autocast.dtype: fp16 does not run on the CPU accelerator",
    "torch_optim_lowercase_sgd_under_zero.json": "optimizer.type: 'sgd' is neither one of DeepSpeed's optimizers nor a "
                                                 "torch.optim class (did you mean 'SGD'?",
    "torch_optim_rmsprop_zero1_untested.json": "optimizer.type: ZeRO stage 1 accepts torch.optim.RMSprop only with "
                                               "\"zero_allow_untested_optimizer\": true",
    "torch_optim_sgd_momentum.json": None,
    "zero1_cpu_offload_optimizer.json": None,
    "zero3_adamw_torch_adam_fast_init.json": None,
    "zero3_legacy_gather_fp16_alias.json": None,
    "zero_stage_auto_without_autotuning.json": "zero_optimization.stage: \"auto\" is not filled from a DeepSpeed "
                                               "JSON (DeepSpeed would silently run stage 0); set 0, 1, 2 or 3",
    "zeropp_hpz_no_quantization.json": None,
    "zeropp_zero3_quantized_hpz.json": "zero_optimization.zero_quantized_gradients, zero_quantized_weights: ZeRO++ "
                                       "quantized communication runs DeepSpeed's quantizer kernel",
    "accelerate_zero3_offload.json": None,
    "examples_bing_bert_lamb.json": "optimizer.type: 'Lamb' runs DeepSpeed's FusedLamb CUDA kernel",
    "examples_cifar_style_zero0.json": None,
    "examples_gpt_adam_warmup.json": None,
    "hf_trainer_fp16_auto_loss_scale.json": None,
    "hf_trainer_zero2_auto.json": None,
    "hf_trainer_zero2_offload.json": None,
    "hf_trainer_zero3_auto.json": None,
    "hf_trainer_zero3_offload.json": None,
    "megatron_activation_block_off.json": None,
    "megatron_activation_partitioning.json": "activation_checkpointing.partition_activations:",
    "megatron_gpt_bf16_zero1.json": None,
    "megatron_gpt_fp16_zero1.json": "fp16.enabled: fp16 does not run on the CPU accelerator",
    "pipeline_section.json": "pipeline: DeepSpeed's pipeline engine needs a PipelineModule",
    "wandb_offline.json": "wandb.enabled: the wandb package is not installed",
    "warmup_cosine_auto_steps.json": None,
    "warmup_decay_fixed_total_steps.json": "scheduler.params.total_num_steps: file says 1000, run gives 3; "
                                           "use --train.steps=1000, or set them to \"auto\" in the file",
    "zero1_flops_profiler_no_optimizer.json": None,
    "zero1_fp16_static_loss_scale.json": "fp16.enabled: fp16 does not run on the CPU accelerator",
    "zero2_bf16_comm_dtypes.json": None,
    "zero2_csv_monitor_comms_logger.json": None,
    "zero2_with_stage3_keys.json": None,  # DeepSpeed ignores stage-3 keys at stage 2: a note says so
    "zero3_nvme_offload.json": "zero_optimization.offload_optimizer.",
    "zero3_tensorboard_no_optimizer.json": None,
    "zero3_typo_in_section.json": "zero_optimization.overlap_com: unknown key (did you mean 'overlap_comm'?)",
}
EXPECT.update({
    "getting_started_zero_bool.json": None,  # DeepSpeed's tutorial: "zero_optimization": true is stage 1
    "deepspeed_chat_bfloat16_key.json": None,  # the legacy "bfloat16" section, read as "bf16"
    "megatron_grad_accum_fp32_zero0.json": "data_types.grad_accum_dtype: fp32 with bf16 weights needs ZeRO stage 1",
    "muadamw_without_mup.json": "optimizer.type: 'MuAdamW' is DeepSpeed's wrapper of the mup package",
    "bf16_string_true_warmupdecay.json": None,  # "enabled": "true", a string DeepSpeed's parser reads as true
    # DeepSpeedExamples' ZenFlow fine-tuning config: every step is an update (ZenFlow's own "boundary" is its
    # full update every update_interval steps), so each step's loss is logged
    "zenflow_zero2_offload.json": None,
    "openrlhf_zero3_auto_stage3_keys.json": None,  # OpenRLHF: "auto" for keys DeepSpeed's parser defaults
    "deepspeed_chat_stage2_with_stage3_keys.json": None,  # DeepSpeed-Chat's default stage 2, stage-3 keys beside
    "llava_zero3_offload_bf16.json": None,  # LLaVA's zero3_offload: fp16 "auto" beside bf16 true, stage 3 offload
    "commented_zero2_readme_style.json": None,  # comments and trailing commas, as DeepSpeed's hjson loader reads
    # a bf16 section with fp16's loss-scale keys: every problem in one refusal (DeepSpeed rejects the keys)
    # round 21: one line for the five keys, with why (was "bf16.loss_scale: unknown key; DeepSpeed rejects it", x5)
    "bf16_with_fp16_loss_scale_keys.json": "bf16.loss_scale, loss_scale_window, hysteresis, min_loss_scale, "
                                           "initial_scale_power: keys of fp16's dynamic loss scaling",
})
# Round 3: Megatron-DeepSpeed / GPT-NeoX templates, DeepSpeed's tutorials (1-bit and 0/1 Adam, schedulers,
# data_types, timers, checkpoint), HF-style "auto" files without a scheduler, and file-format accidents.
EXPECT.update({
    "adam_bias_correction_false.json": None,  # bing_bert's Adam: DeepSpeed builds it (no torch counterpart)
    "apex_amp_o1_section.json": "top-level key 'amp' is no longer supported",
    "batch_triple_for_four_gpus.json": "train_batch_size 32 != train_micro_batch_size_per_gpu 4 x "
                                       "gradient_accumulation_steps 2 x 2 data-parallel ranks = 16",
    "bert_sparse_gradients.json": "top-level key 'sparse_gradients' is no longer supported",
    "bf16_and_fp16_both_enabled.json": "bf16.enabled, fp16.enabled: both true; DeepSpeed allows only one",
    "checkpoint_node_local_storage.json": None,
    "comet_monitor.json": "comet.enabled: the comet_ml package is not installed",
    "data_efficiency_disabled_block.json": None,  # a disabled data_efficiency block is fine
    "data_types_param_dtype_bf16.json": None,  # param_dtype bf16 with bf16 "auto": the weights are bf16
    "duplicate_keys_merge_leftover.json": "duplicate key 'stage'",
    "empty_object.json": None,  # {}: everything from the run
    "ga_only.json": None,
    "gpt_neox_onebitadam_fp16.json": "optimizer.type: 'OneBitAdam': DeepSpeed 0.19 no longer has its 1-bit Adam "
                                     "optimizer",
    "gradient_allreduce_op_sum.json": None,  # summed gradients, as DeepSpeed runs them
    "hf_lr_auto_no_scheduler.json": None,  # no scheduler block: dstrain's warm-up + cosine at the run's lr
    "lowercase_warmuplr_scheduler.json": "scheduler.type: 'warmuplr' is neither one of DeepSpeed's schedulers",
    "megatron_ds_train_batch_only_wallclock.json": None,  # train_batch_size alone: micro 8 x 2 ranks, accumulation 1
    "megatron_fp16_off_bf16_on_loss_scale_keys.json": None,
    "micro_batch_only_zero1.json": None,
    "numbers_as_strings.json": "optimizer.params.lr: must be a number or \"auto\", file says \"1e-5\" (a string",
    "param_dtype_bf16_with_bf16_off.json": "data_types.param_dtype: file says \"bf16\", its bf16 / fp16 sections "
                                           "make the weights fp32",
    "prescale_predivide_zero2.json": "prescale_gradients, gradient_predivide_factor: ZeRO stage 2 with reduce_scatter "
                                     "does not support them",
    "stage0_offload_none_leftovers.json": None,  # offload "none" at stage 0; the unused keys get a note
    "tb_and_ga_only.json": None,
    "timers_throughput_steps_per_print.json": None,
    "top_level_list.json": "top level must be a JSON object, got list",
    "torch_autocast_lower_precision_modules.json": None,
    "torch_cosine_annealing_scheduler.json": "scheduler.type: torch.optim.lr_scheduler.CosineAnnealingLR takes only "
                                             "a torch optimizer, and with ZeRO stage 1",
    "torch_steplr_zero0_fp32.json": None,  # a torch scheduler on the client optimizer itself (stage 0, fp32)
    "utf8_bom_windows_editor.json": None,
    "warmup_cosine_min_ratio_linear.json": None,
    "warmupdecay_nonzero_min_lr_log.json": None,
    "warmuplr_linear_type_fixed.json": None,
    "warmuplr_with_total_num_steps.json": "scheduler.params.total_num_steps: WarmupLR does not take it",
    "zero2_offload_ratio_stage3_only.json": "zero_optimization: Partial offloading only supported for ZeRO Stage 3",
    "zero3_float_bucket_sizes.json": None,
    "zero_one_adam_var_freeze.json": "optimizer.type: 'ZeroOneAdam': DeepSpeed 0.19 no longer has its 0/1 Adam",
    "steps_per_print_zero.json": "steps_per_print: 0 stops rank 0 at its first step",
    "zero3_partial_offload_ratio.json": None,  # ZeRO-Offload++'s partial optimizer offload (ratio) at stage 3
    "bf16_master_weights_optimizer_states.json": None,
    "muon_optimizer_zero2.json": None,  # DeepSpeed's Muon (with its auxiliary Adam), built by DeepSpeed
})
# Round 4: LLaMA-Factory / Axolotl / DeepSpeed-Chat / BLOOM / Accelerate files, and hostile ones (NaN, Infinity,
# non-UTF-8 bytes, an empty file, torch's AdamW kwargs, "auto" inside a list, typos of section names).
EXPECT.update({
    "accelerate_yaml_keys_in_json.json": "unknown top-level key 'zero3_init_flag'",
    "adamw_torch_kwargs_fused.json": "optimizer.params.foreach, fused: DeepSpeed's FusedAdam, which DeepSpeed builds "
                                     "from this block, does not take them",
    "axolotl_zero1_fp16_auto_loss_keys.json": None,
    "betas_list_of_autos.json": "optimizer.params.betas: \"auto\" stands for the whole value (\"betas\": \"auto\"), "
                                "not for one of its numbers",
    "bloom_megatron_train_batch_2048.json": None,  # 2 x 512 x 2 ranks: the file's accumulation, taken as it is
    "deepspeed_chat_actor_hybrid_engine_off_bf16.json": None,  # a disabled hybrid_engine block is fine
    "eight_gpu_batch_and_micro_only.json": None,  # written for 8 GPUs: on 2 ranks accumulation 4, as DeepSpeed derives
    "empty_file.json": "the file is empty",
    "grad_accum_fp32_bf16_auto_stage0.json": None,  # bf16 "auto" with fp32 accumulation at stage 0: trained in fp32
    "gradient_accumulation_step_typo.json": "unknown top-level key 'gradient_accumulation_step' (did you mean "
                                            "'gradient_accumulation_steps'?)",
    "gradient_clipping_zero_disables.json": None,  # 0 turns clipping off, as DeepSpeed reads it
    "hjson_quoteless_values.json": None,  # "type": AdamW without quotes, as DeepSpeed's hjson loader reads it
    "huge_bucket_sizes_1e20.json": "zero_optimization.reduce_bucket_size: file says 1e+20, more than DeepSpeed's "
                                   "integer holds",
    "infinity_lr_and_eps.json": "optimizer.params.lr: Infinity is not a JSON number",
    "latin1_comment_bytes.json": "not UTF-8 text: byte 0xe9 at line 2, column 7",
    "llama_factory_zero2_offload_round_robin.json": None,
    "megatron_bf16_zero1_grad_accum_fp32.json": None,
    "megatron_sparse_attention_fixed.json": "top-level key 'sparse_attention' is no longer supported",
    "micro_batch_float_four.json": None,  # 4.0 is 4 to DeepSpeed's hjson loader
    "nan_gradient_clipping.json": "gradient_clipping: NaN is not a JSON number",
    "negative_weight_decay_and_warmup.json": "optimizer.params.weight_decay: must be a number >= 0",
    "offload_device_uppercase_cpu.json": "zero_optimization.offload_optimizer.device: Input should be 'none', 'cpu' "
                                         "or 'nvme', file says 'CPU'",
    "optimizer_type_auto.json": "optimizer.type: \"auto\" is not a type dstrain chooses",
    "top_level_number_stage.json": "top level must be a JSON object, got int",
    "top_level_string_path.json": "top level must be a JSON object, got str",
    "training_arguments_pasted_in.json": "unknown top-level key 'learning_rate'",
    "warmup_longer_than_run.json": None,  # 2000 warm-up steps in a 3-step run: the file's choice, run as written
    "warmup_max_lr_differs_from_lr.json": None,  # WarmupLR sets the lr: warmup_max_lr is the run's, lr unused
    "zero2_elastic_checkpoint_fp32_weights.json": None,
    "zero3_offload_param_buffer_floats.json": None,
    "zero_optimisation_british_spelling.json": "unknown top-level key 'zero_optimisation' (did you mean "
                                               "'zero_optimization'?)",
    "zero_stage_as_string.json": None,  # "stage": "2" is stage 2 to DeepSpeed's parser
    # round 5
    "adam_three_betas.json": "optimizer.params.betas: must be two numbers in [0, 1) or \"auto\", file says [0.9, "
                             "0.95, 0.999]",
    "adamw_amsgrad_true.json": None,  # dstrain's torch AdamW takes amsgrad (DeepSpeed's FusedAdam would refuse it)
    "comms_logger_with_flops_profiler.json": None,
    "deepspeed_chat_hybrid_engine_enabled.json": "hybrid_engine.enabled: the hybrid engine is for DeepSpeed-Chat's "
                                                 "RLHF loop",
    "ga_auto_with_explicit_train_batch.json": None,
    "gradient_clipping_and_steps_per_print_auto.json": "steps_per_print: \"auto\" is not a value dstrain can fill "
                                                       "(DeepSpeed itself keeps the text \"auto\")",
    "mixed_case_keys.json": "unknown top-level key 'Train_Batch_Size' (did you mean 'train_batch_size'?)",
    "nested_under_deepspeed_key.json": "top-level key 'deepspeed' holds a DeepSpeed config one level down",
    "onecycle_cycle_momentum_adamw.json": None,
    "optimizer_as_plain_string.json": "optimizer: must be an object, file says \"AdamW\"; write {\"type\": \"AdamW\"}",
    "tensorboard_and_csv_same_output_path.json": None,
    "tensorboard_csv_wandb_together.json": "wandb.enabled: the wandb package is not installed here",
    "torch_lr_scheduler_dotted_steplr.json": "(write 'StepLR': DeepSpeed looks the bare class name up itself)",
    "torch_optim_dotted_adamw.json": "(write 'AdamW': DeepSpeed looks the bare class name up itself)",
    "zero3_param_offload_none_gather_true.json": None,
    "zero3_param_offload_only_cpu.json": None,
    "zero3_save_16bit_model_in_zero_block.json": "zero_optimization.zero3_save_16bit_model: unknown key",
})
# Round 6: DeepSpeed 0.18-0.19 features (SuperOffload, AutoTP training, Ulysses, DeepCompile, ZeRO-3 leaf modules
# and granularity threshold), DeepSpeedExamples' removed features (progressive layer drop, Nebula), and generated
# files that quote booleans and numbers ("pin_memory": "True", "enabled": "true", "reduce_bucket_size": "5e8").
EXPECT.update({
    "apex_amp_disabled_block.json": "top-level key 'amp' is no longer supported",  # DeepSpeed raises even if disabled
    "autotp_training_tensor_parallel_two.json": "tensor_parallel: DeepSpeed's AutoTP is not used by dstrain",
    "bing_bert_progressive_layer_drop.json": "top-level key 'progressive_layer_drop' is no longer supported",
    "data_types_grad_accum_bf16_zero1.json": None,
    "deepcompile_zero3_compile_section.json": "compile: dstrain compiles the model itself; remove the section and use "
                                              "--train.compile=true",
    "examples_superoffload_zero3_cpuadam_cores.json": "zero_optimization.offload_optimizer.super_offload: SuperOffload "
                                                      "runs only on NVIDIA CUDA GPUs",
    "gradient_predivide_factor_zero1.json": None,  # stage 1 does not partition gradients: DeepSpeed honours it
    "hf_dataloader_drop_last_true.json": None,  # DeepSpeed accepts it; dstrain's batches are always full (a note)
    "hf_zero2_offload_string_booleans.json": None,  # "pin_memory": "True": booleans DeepSpeed's parser reads
    "nebula_checkpoint_section.json": "top-level key 'nebula' is no longer supported",
    "ulysses_sequence_parallel_size_two.json": "sequence_parallel_size: dstrain splits sequences itself; remove the "
                                               "key and use --parallel.sp=2",
    "zero3_bucket_sizes_quoted_numbers.json": "zero_optimization.reduce_bucket_size: file says '5e8', a number in "
                                              "quotes, which DeepSpeed's parser does not read as a number (it "
                                              "rejects it); write it without the quotes: 5e8",
    "zero3_ignore_unused_parameters_false.json": None,  # a stage-1/2 key at stage 3: a note says so
    "zero3_leaf_module_moe_classes.json": None,  # no module of the class: DeepSpeed marks none (as it would)
    # DeepSpeed's granularity rule makes the whole model one leaf first, and its ZeRO-3 backward then fails
    "zero3_module_granularity_all_reduce_fetch.json": "zero_optimization.stage3_module_granularity_threshold: 100000 "
                                                      "makes the whole model (GPT, 21613 parameters per layer) one "
                                                      "leaf module",
    "zero_force_ds_cpu_optimizer_false_torch_adam.json": None,
    # quoted booleans: pydantic sections (monitors, bf16, ZeRO) read "true" as true, and so do DeepSpeed's plain keys
    "monitors_enabled_as_strings.json": None,
    # ... but to a plain key "false" is true too, and wall_clock_breakdown stops DeepSpeed's parser ("bool | str")
    "wall_clock_breakdown_quoted_false.json": "wall_clock_breakdown: file says 'false' in quotes, which DeepSpeed does "
                                              "not read as a boolean",
    "zeropp_quantized_flags_as_strings.json": "zero_optimization.zero_quantized_gradients, zero_quantized_weights: "
                                              "ZeRO++ quantized communication runs DeepSpeed's quantizer kernel",
})
# Round 7: optimizer types DeepSpeed builds under offload (CPU Adagrad / Lion, torch_adam), Adam in L2 mode, blocks
# without params, DeepSpeed 0.19's checkpoint writer and AutoEP sections, hpZ, ZeRO-3 with no prefetch, removed keys.
EXPECT.update({
    "adam_l2_mode_weight_decay.json": None,  # "adam_w_mode": false: torch.optim.Adam with L2, as DeepSpeed's Adam
    "adamw_type_without_params.json": None,  # no params: DeepSpeed's defaults (lr 1e-3), each printed as adopted
    "adamw_fp32_optimizer_states_false.json": None,  # a CPU Adam param under offload: DeepSpeed builds it
    "autoep_expert_parallel_section.json": "expert_parallel.enabled: DeepSpeed's AutoEP replaces a model's MoE "
                                           "layers, and dstrain's models have none",
    "checkpoint_fast_writer.json": "checkpoint.writer.type: DeepSpeed's fast checkpoint writer",
    "checkpoint_python_writer_replica.json": None,  # the plain-I/O writer saves DeepSpeed's usual files
    "checkpoint_parallel_write_pipeline_stage.json": None,  # read by the pipeline engine only, as DeepSpeed does
    "flops_profiler_recompute_fwd_factor.json": None,
    "lion_zero2_cpu_offload.json": None,  # Lion under offload: DeepSpeed's CPU Lion, no CUDA kernel
    "lr_range_test_staircase.json": None,
    "quantize_training_moq.json": "top-level key 'quantize_training' is no longer supported",
    "random_ltd_data_routing.json": "data_efficiency.enabled: dstrain's samplers feed the data",
    "torch_adafactor_zero2_untested.json": None,  # torch.optim.Adafactor by name, vetted by the file
    "warmup_cosine_zero_warmup_steps.json": "scheduler.params.warmup_num_steps: must be a positive integer "
                                            "(DeepSpeed's warm-up schedulers raise on 0",
    "zero1_param_offload_below_stage3.json": "set \"stage\": 3, or remove offload_param",
    "zero2_cpu_offload_adagrad.json": None,  # Adagrad under offload: DeepSpeed's CPU Adagrad
    "zero2_offload_torch_adam.json": None,  # torch_adam under offload: torch's AdamW on the CPU partitions
    "zero3_hpz_larger_than_world.json": None,  # hpZ 8 on 2 ranks: DeepSpeed groups min(8, 2) = all of them
    "zero3_live_params_zero_no_prefetch.json": None,  # no prefetch, nothing kept live: slower, same training
    "zero3_mics_shard_size_minus_one.json": "zero_optimization.mics_hierarchical_params_gather, mics_shard_size: "
                                            "MiCS sharding was removed from DeepSpeed; remove them",
    "zero3_param_nvme_optimizer_cpu.json": "zero_optimization.offload_param.",
    "zeropp_loco_param.json": "zero_optimization.zeropp_loco_param: LoCo-ZeRO++ was removed from DeepSpeed",
})
# Round 8: keys DeepSpeed's parser stores and its engine trips over at start-up or at the first step (log_level,
# datastates_ckpt, managed_gradient_accumulation, compute_grad_norm, torch's LBFGS / ReduceLROnPlateau / capturable),
# warm-up types it replaces silently, and odd-but-valid keys that train as written.
EXPECT.update({
    "checkpoint_load_universal_true.json": "checkpoint.load_universal: DeepSpeed would load every checkpoint as a "
                                           "universal one",  # it trained and saved; the resume stopped on every rank
    "checkpoint_tag_validation_lowercase_fail.json": None,  # DeepSpeed upper-cases the tag_validation mode
    "datastates_ckpt_enabled_false.json": "datastates_ckpt: DeepSpeed turns DataStates asynchronous checkpointing on "
                                          "for any value but false",
    "disable_python_gc_true.json": None,
    "gradient_allreduce_op_avg.json": "Invalid gradient_allreduce_op. Supported operations: ['mean', 'sum']",
    "gradient_allreduce_op_sum_zero3.json": "gradient_allreduce_op='sum' is not supported with ZeRO stage 3",
    "log_level_info.json": None,  # "INFO": DeepSpeed lower-cases it
    "log_level_warn_abbrev.json": "log_level: DeepSpeed takes one of debug, info, warning, error, critical",
    "managed_gradient_accumulation_false.json": "managed_gradient_accumulation: false hands the accumulation boundary "
                                                "to the training loop",
    "onecycle_auto_lrs.json": "scheduler.params.cycle_min_lr: \"auto\" is not a value dstrain can fill",
    "tensorboard_enabled_no_output_path.json": None,  # no output_path: DeepSpeed's default, inside the run folder
    "torch_adam_fused_cpu.json": None,  # torch's fused AdamW has a CPU kernel
    "torch_adamw_capturable_foreach.json": "optimizer.params.capturable: true keeps torch's optimizer step on a GPU",
    "torch_lbfgs_zero0.json": "optimizer.type: torch.optim.LBFGS re-evaluates the loss through a closure",
    "torch_reduce_lr_on_plateau_zero0.json": "scheduler.type: torch's ReduceLROnPlateau steps on a metric",
    "vocabulary_size_unaligned.json": None,  # DeepSpeed only warns that 50257 is not a multiple of 8
    "warmup_cosine_type_cosine_typo.json": "scheduler.params.warmup_type: WarmupCosineLR knows only \"log\" and "
                                           "\"linear\", file says 'cosine'",
    "warmuplr_type_capitalised_linear.json": "write \"linear\" (the names are lower case)",
    "zero2_compute_grad_norm_false_clipping.json": "zero_optimization.compute_grad_norm: false needs "
                                                   "\"gradient_clipping\": 0",
    "zero1_legacy_stage1_true.json": "zero_optimization.legacy_stage1: true asks for the ZeRO stage 1 of DeepSpeed "
                                     "< 0.5.9",
    "zero2_compute_grad_norm_false_no_clipping.json": None,  # no global norm, no clipping: as DeepSpeed runs it
    "zero2_offload_torch_sgd.json": None,  # torch's SGD on the offloaded partitions, vetted by the file
    "zero2_reduce_bucket_size_zero.json": "zero_optimization.reduce_bucket_size: Input should be greater than 0",
    "zero3_flops_profiler.json": None,  # the profiler counts ZeRO-3's partitioned parameters
    "zero3_grad_accum_fp32_bf16.json": None,  # bf16 weights, fp32 accumulation at stage 3: DeepSpeed's ZeRO-3 runs it
    "zero3_offload_ratio_zero.json": None,  # ratio 0: ZeRO-Offload++ keeps every partition's step on the device
    "zero2_parameter_alignment_true.json": None,
    "zero3_hpz_zero.json": None,  # hpZ 0: no secondary partition, as 1
})
# Round 9: scheduler sizes DeepSpeed checks only when the engine builds the scheduler (LRRangeTest / OneCycle), a
# last_batch_iteration that starts a fresh run partway into the schedule, weight_quantization (inference-only, or
# acting only inside zero.Init), and odd-but-valid ZeRO keys that train as written.
EXPECT.update({
    "adamw_adam_w_mode_false.json": None,  # DeepSpeed's AdamW stays AdamW whatever adam_w_mode says; so does dstrain's
    "bf16_grad_accum_fp16.json": "data_types.grad_accum_dtype: fp16 does not run on the CPU accelerator",
    "gradient_clipping_negative.json": "gradient_clipping: must be a number >= 0",
    "lr_range_test_step_size_fraction.json": "scheduler.params.lr_range_test_step_size: LRRangeTest needs a positive "
                                             "integer, file says 2.5",
    "lr_range_test_step_size_zero.json": "scheduler.params.lr_range_test_step_size: LRRangeTest needs a positive "
                                         "integer, file says 0",  # it passed the checks; every rank raised ValueError
    "onecycle_decay_step_size_zero.json": None,  # 0: DeepSpeed's "no decay after the cycle"
    "onecycle_first_step_size_zero.json": "scheduler.params.cycle_first_step_size: OneCycle needs a number > 0",
    "onecycle_second_step_size_negative.json": "scheduler.params.cycle_second_step_size: OneCycle needs a number >= 0",
    "openrlhf_zero2_bf16_grad_accum_fp32.json": None,  # stage-3 keys at stage 2 noted; bf16 + fp32 accumulation runs
    "warmup_cosine_last_batch_iteration.json": "scheduler.params.last_batch_iteration: 100 starts a fresh run "
                                               "partway into WarmupCosineLR",
    "warmuplr_last_batch_iteration.json": "scheduler.params.last_batch_iteration: 5 starts a fresh run partway into "
                                          "WarmupLR",  # it trained, step 1 at optimizer.params.lr
    "warmuplr_per_group_max_lr_list.json": "scheduler.params.warmup_max_lr: must be a number",
    "zero2_allgather_bucket_size_zero.json": None,
    "zero2_load_from_fp32_weights_false.json": None,  # resumed too: the fp32 master weights come from the bf16 ones
    "zero2_reduce_scatter_false.json": None,  # all-reduce instead of reduce-scatter, no allgather_partitions
    "zero3_offload_param_buffer_count_zero.json": None,
    "zero3_prefetch_bucket_size_zero.json": None,  # no prefetch, nothing persistent: every parameter fetched on use
    "zero3_sub_group_size_zero.json": None,
    "zero3_weight_quantization_post_init_quant.json": "weight_quantization.post_init_quant: read only by DeepSpeed's "
                                                      "inference quantization",  # it trained unquantized
    "zero3_weight_quantization_quantized_init.json": "weight_quantization.quantized_initialization: DeepSpeed "
                                                     "quantizes the weights only inside zero.Init",
    "torch_lambda_lr_string_lambda.json": "scheduler.type: torch's LambdaLR takes Python objects as lr_lambda",
    "torch_one_cycle_lr_shorter_than_run.json": "scheduler.params.epochs: torch's OneCycleLR runs 2 steps (epochs x "
                                                "steps_per_epoch) and the run 3",  # torch raised at step 3
    "torch_cosine_warm_restarts_t0_zero.json": "scheduler.params: torch's CosineAnnealingWarmRestarts refuses the "
                                               "file's params (Expected positive integer T_0, but got 0)",
    "torch_linear_lr_start_factor_zero.json": "scheduler.params: torch's LinearLR refuses the file's params",
    "torch_one_cycle_lr_total_steps.json": None,  # torch's OneCycleLR over 100 steps: DeepSpeed steps it per update
    "torch_sequential_lr_scheduler_names.json": "scheduler.type: torch's SequentialLR takes Python objects as "
                                                "schedulers",
})
# Round 10: keys DeepSpeed reads elsewhere than the file puts them (settings beside "type", data_efficiency's inner
# switches, typos in data_types / checkpoint), dtypes its engine reads case-sensitively at start-up, "~" monitor paths,
# and 1 / 0 for booleans (read as DeepSpeed reads them).
EXPECT.update({
    "optimizer_params_beside_type.json": "optimizer.lr, betas, eps, weight_decay: written beside \"type\", where "
                                         "DeepSpeed never reads them",  # it built AdamW at its default lr 1e-3
    "scheduler_params_beside_type.json": "scheduler.warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps: "
                                         "written beside \"type\"",
    "optimizer_param_key_typo.json": "optimizer.param: unknown key (did you mean 'params'?)",
    "megatron_data_efficiency_off_random_ltd_on.json": "data_efficiency.data_routing.random_ltd.enabled: DeepSpeed "
                                                       "reads it whatever data_efficiency.enabled",
    "data_efficiency_off_curriculum_on.json": "data_efficiency.data_sampling.curriculum_learning.enabled: DeepSpeed "
                                              "reads it whatever data_efficiency.enabled says",
    "data_types_grad_accum_dtype_typo.json": "data_types.gradient_accumulation_dtype: unknown key (did you mean "
                                             "'grad_accum_dtype'?)",
    "checkpoint_node_local_storage_typo.json": "checkpoint.node_local_storage: unknown key (did you mean "
                                               "'use_node_local_storage'?)",
    # DeepSpeed's parser keeps them; its engine raised "'FP32' is not a valid DtypeEnum" in initialize, every rank
    "megatron_grad_accum_dtype_upper_fp32.json": "data_types.grad_accum_dtype: DeepSpeed's dtype names are lower case",
    "data_types_param_dtype_upper_bf16.json": "data_types.param_dtype: DeepSpeed's dtype names are lower case",
    "data_types_buffer_dtype_float64.json": "data_types.buffer_dtype: must be one of DeepSpeed's dtype names",
    "tensorboard_csv_home_tilde_paths.json": "tensorboard.output_path: '~/ds_logs/tensorboard' starts with '~', which "
                                             "DeepSpeed does not expand",
    "megatron_deepspeed_config_wrapper.json": "top-level key 'deepspeed_config' holds a DeepSpeed config one level down",
    "python_dict_printed_config.json": "(the file is a Python dict: single-quoted keys, True / False / None, which "
                                       "DeepSpeed's JSON / hjson loader cannot read either); write it with json.dump",
    "gradient_predivide_factor_quoted_zero0.json": "gradient_predivide_factor: file says '16', a number in quotes",
    "torch_autocast_safe_module_typo.json": "torch_autocast.lower_precision_safe_module: unknown key (did you mean "
                                            "'lower_precision_safe_modules'?)",  # DeepSpeed used its default list
    "deepspeed_chat_hybrid_engine_off_typo.json": "hybrid_engine.max_out_token: unknown key (did you mean "
                                                  "'max_out_tokens'?); DeepSpeed rejects it",
    # by hand: DeepSpeed's "if adam_w_mode" read the text as true (AdamW, not Adam with L2); torch's SGD took Nesterov
    "adam_l2_mode_quoted_false.json": "optimizer.params.adam_w_mode: file says 'false' in quotes",
    "torch_sgd_nesterov_quoted_false.json": "optimizer.params.nesterov: file says 'false' in quotes",
    "yaml_dump_null_optimizer_scheduler.json": "optimizer: null (an empty entry, as a YAML-to-JSON dump writes one), "
                                               "which DeepSpeed's config parser stops on",
    "bf16_enabled_one_fp16_zero.json": None,  # 1 / 0 for enabled and plain flags: booleans to DeepSpeed (refused before)
    "megatron_bf16_zero1_grad_accum_torch_float32.json": None,  # a DtypeEnum name (refused before)
    "zero2_generated_quoted_ints_int_flags.json": None,  # "200000000" is a number to DeepSpeed's lax parser; 1 is true
    "checkpoint_serialization_false.json": None,  # torch's legacy format: saved at step 2 and resumed
    "data_types_buffer_dtype_keep_fp32_bf16.json": None,
    "warmuplr_params_null.json": None,  # "params": null filled from the run (DeepSpeed alone stops on the scheduler's)
})
# Round 11: what the classes DeepSpeed builds from the optimizer and scheduler blocks take (Adagrad, CPU Lion, Muon,
# torch's SGD) and change without a word (OneCycle's betas, LRRangeTest from 0), a profile step the run never reaches,
# deprecated ZeRO keys beside their replacements, NVMe-only keys under CPU offload, quoted text where a list belongs.
EXPECT.update({
    "adagrad_adam_betas_copied.json": "optimizer.params.betas: torch.optim.Adagrad (DeepSpeed's class for Adagrad "
                                      "without offload) does not take it",
    "adagrad_offload_lr_decay.json": "optimizer.params.initial_accumulator_value, lr_decay: DeepSpeed's CPU Adagrad "
                                     "(its class under optimizer offload) does not take them",
    "lion_offload_adam_eps.json": "optimizer.params.eps: DeepSpeed's CPU Lion (its class under optimizer offload) does "
                                  "not take it",
    "torch_sgd_nesterov_without_momentum.json": "optimizer.params.nesterov: torch.optim.SGD refuses the file's values "
                                                "(Nesterov momentum requires a momentum and zero dampening)",
    "muon_nesterov_ns_steps.json": "optimizer.params.nesterov, ns_steps: DeepSpeed's Muon never reads them",
    "muon_lr_adam_lr_split.json": None,  # every key one DeepSpeed's Muon reads (muon_lr / adam_lr per half)
    # OneCycle working as DeepSpeed built it (cycling turned off for SGD; beta2 written as 0.99): trains, with a note
    "onecycle_sgd_cycle_momentum.json": None,
    "onecycle_adamw_beta2_095.json": None,
    "onecycle_momentum_off_adamw_beta2_095.json": None,  # cycle_momentum false: the betas stay the file's
    "flops_profiler_profile_step_past_run.json": "flops_profiler.profile_step: 10, and the run takes 3 steps",
    "zero2_cpu_offload_with_offload_block.json": "zero_optimization.cpu_offload: the deprecated spelling of "
                                                 "offload_optimizer, and the file has both",
    "zero3_gather_fp16_and_16bit_both.json": "remove stage3_gather_fp16_weights_on_model_save and keep "
                                             "stage3_gather_16bit_weights_on_model_save",
    "zero3_cpu_offload_param_with_block.json": "remove cpu_offload_param and keep offload_param",
    "lr_range_test_min_lr_zero.json": "scheduler.params.lr_range_test_min_lr: file says 0; LRRangeTest multiplies it",
    "fp16_loss_scale_dynamic_string.json": "fp16.loss_scale: Value error, fp16.loss_scale must be a number, file says "
                                           "'dynamic'",
    "comms_logger_prof_ops_string.json": "comms_logger.prof_ops: Input should be a valid list, file says 'all_reduce'",
    "zero3_offload_cpu_with_nvme_keys.json": None,  # a ZeRO-Infinity template set to "cpu": notes name the NVMe keys
    "train_batch_size_scientific_notation.json": None,  # 3.2e1 is 32 to DeepSpeed's hjson loader: micro 4 x 4 x 2
    # by hand: trained 3 steps, exit 0, and every model / optimizer state file of both checkpoints was 0 bytes
    "checkpoint_mock_writer.json": "checkpoint.writer.type: DeepSpeed's mock writer opens each checkpoint file and "
                                   "counts the bytes without writing them",
    # by hand: the run stopped in initialize ('UniversalParallelInfo' object has no attribute 'dp_rank')
    "checkpoint_python_writer_no_data_parallel.json": "checkpoint.writer.data_parallel: absent, which DeepSpeed "
                                                      "0.19.8 reads as one writer (rank 0) and fails to set up at ZeRO "
                                                      "stage 2",
    # by hand: trained 2 steps, then the run stopped at the step-2 checkpoint (torch would not pickle the state)
    "checkpoint_decoupled_python_writer.json": "checkpoint.writer.decoupled: true hands each checkpoint to a writer "
                                               "process through a queue",
    # torch's CyclicLR cycles momentum by default, and torch's Adagrad (what DeepSpeed builds) has none
    "torch_cycliclr_adagrad_stage0.json": "scheduler.params: torch's CyclicLR refuses the file's params (optimizer "
                                          "must support momentum or beta1 with `cycle_momentum` option enabled)",
    "adamw_amsgrad_cpu_offload.json": "optimizer.params.amsgrad: true under optimizer offload, where DeepSpeed builds "
                                      "its CPU Adam, which refuses it",
    "comms_logger_prof_ops_typo_allreduce.json": "comms_logger.prof_ops: 'allreduce', 'allgather' are not names of "
                                                 "ops DeepSpeed's comms logger logs",
    "lr_range_test_step_rate_zero.json": "scheduler.params.lr_range_test_step_rate: file says 0; LRRangeTest's lr is "
                                         "lr_range_test_min_lr x (1 + step_rate x interval), so it would never move",
})
#: Round-4 trainable files checked before launch only: each one's run shows nothing the files that do run (and
#: earlier rounds') do not (kept out of the slow runs to keep them few).
CHECKED_ONLY = {"axolotl_zero1_fp16_auto_loss_keys.json", "bloom_megatron_train_batch_2048.json",
                "eight_gpu_batch_and_micro_only.json", "gradient_clipping_zero_disables.json",
                "hjson_quoteless_values.json", "megatron_bf16_zero1_grad_accum_fp32.json",
                "warmup_longer_than_run.json", "zero2_elastic_checkpoint_fp32_weights.json",
                "zero3_offload_param_buffer_floats.json", "zero_stage_as_string.json",
                # round 5: each trained 4 steps on 2 CPU ranks by hand (nothing new to show in the slow runs)
                "adamw_amsgrad_true.json", "comms_logger_with_flops_profiler.json",
                "ga_auto_with_explicit_train_batch.json", "onecycle_cycle_momentum_adamw.json",
                "tensorboard_and_csv_same_output_path.json", "zero3_param_offload_none_gather_true.json",
                "zero3_param_offload_only_cpu.json",
                # round 6: a note each and nothing else new (DeepSpeed ignores both keys here)
                "hf_dataloader_drop_last_true.json", "zero3_ignore_unused_parameters_false.json",
                # round 7: each trained 3 steps on 2 CPU ranks by hand (the python writer with a checkpoint)
                "checkpoint_python_writer_replica.json", "lion_zero2_cpu_offload.json",
                "torch_adafactor_zero2_untested.json", "zero2_cpu_offload_adagrad.json",
                "zero3_live_params_zero_no_prefetch.json",
                # round 8: each trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand (as written)
                "checkpoint_tag_validation_lowercase_fail.json", "disable_python_gc_true.json", "log_level_info.json",
                "torch_adam_fused_cpu.json", "vocabulary_size_unaligned.json", "zero3_grad_accum_fp32_bf16.json",
                "zero3_offload_ratio_zero.json", "zero2_parameter_alignment_true.json", "zero3_hpz_zero.json",
                # round 9: each trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand (as written)
                "adamw_adam_w_mode_false.json", "onecycle_decay_step_size_zero.json",
                "openrlhf_zero2_bf16_grad_accum_fp32.json", "zero2_allgather_bucket_size_zero.json",
                "zero2_load_from_fp32_weights_false.json", "zero2_reduce_scatter_false.json",
                "zero3_offload_param_buffer_count_zero.json", "zero3_prefetch_bucket_size_zero.json",
                "zero3_sub_group_size_zero.json", "torch_one_cycle_lr_total_steps.json",
                # round 10: each trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand (the two files
                # refused before also run in tests/unit/test_ds_realworld10.py with -m slow)
                "bf16_enabled_one_fp16_zero.json", "megatron_bf16_zero1_grad_accum_torch_float32.json",
                "zero2_generated_quoted_ints_int_flags.json", "checkpoint_serialization_false.json",
                "data_types_buffer_dtype_keep_fp32_bf16.json", "warmuplr_params_null.json",
                # round 11: each trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand (as written)
                "muon_lr_adam_lr_split.json", "onecycle_momentum_off_adamw_beta2_095.json",
                "zero3_offload_cpu_with_nvme_keys.json", "train_batch_size_scientific_notation.json",
                "onecycle_sgd_cycle_momentum.json", "onecycle_adamw_beta2_095.json"}
if importlib.util.find_spec("comet_ml") is not None:
    EXPECT["comet_monitor.json"] = None
if importlib.util.find_spec("mup") is not None:
    EXPECT["muadamw_without_mup.json"] = None
if importlib.util.find_spec("wandb") is not None:  # then it is honoured (offline) instead
    EXPECT["wandb_offline.json"] = None
    EXPECT["tensorboard_csv_wandb_together.json"] = None
    CHECKED_ONLY.add("tensorboard_csv_wandb_together.json")

# Rounds 12 on: their own module (kept apart to keep each file to one screenful of rounds), merged last as before.
from tests.configs import expectations_late as _late  # noqa: E402

EXPECT.update(_late.EXPECT)
CHECKED_ONLY |= _late.CHECKED_ONLY
