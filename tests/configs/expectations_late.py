"""Expectations of the files added from round 12 on (``tests/unit/test_ds_realworld12.py`` and later), in the form
of :mod:`tests.configs.expectations`, which merges them into its tables after the earlier rounds'."""
from __future__ import annotations

EXPECT: dict[str, str | None] = {}
CHECKED_ONLY: set[str] = set()

# Round 12: the files people copy today, in their exact shapes: Accelerate's docs and resolved dumps, LLaMA-Factory's,
# axolotl's, OpenRLHF's / TRL's reference-model configs, DeepSpeed-Chat's eval config, Megatron-DeepSpeed's templates
# and run-script heredocs, DeepSpeed tutorials' leftovers (keys DeepSpeed 0.19 renamed, ignores or removed).
EXPECT.update({
    "accelerate_docs_zero2_torch_adam_warmupdecay.json": None,
    "accelerate_docs_zero3_offload_gather_auto.json": None,  # gather "auto": DeepSpeed's default (false), a note
    "accelerate_plugin_dump_nvme_path_null.json": None,  # "nvme_path": null under "cpu" / "none"; a stage-3 key noted
    # Accelerate writes steps_per_print inf: json.dump's Infinity, which DeepSpeed's hjson loader reads as text
    "accelerate_resolved_dump_steps_per_print_inf.json": "steps_per_print: Infinity is not a JSON number",
    # DeepSpeed before DeepCompile's torch.compile switches: named, with the fix (was "unknown key" alone)
    "axolotl_zero1_torch_compile.json": "compile.disable, backend: torch.compile settings of DeepSpeed before "
                                        "DeepCompile; DeepSpeed 0.19's compile section configures DeepCompile only "
                                        "and rejects them as unknown keys; remove them and pass --train.compile=true",
    "axolotl_zero2_bf16_immediate_grad_update_false.json": None,
    "axolotl_zero3_bf16.json": None,  # sub_group_size / live parameters / reuse distance 0, fp16 "auto" beside bf16
    "ds_old_fp16_auto_cast_bf16_on.json": None,  # fp16 off with auto_cast: unread; round_robin_gradients at stage 2
    "ds_tutorial_zero_offload_amp_disabled_memory_breakdown.json": "top-level key 'amp' is no longer supported",
    "dschat_eval_config_stage0_offload_none.json": None,  # stage-3 keys and memory_efficient_linear at stage 0: a note
    "hf_trainer_zero3_legacy_gather_fp16_only_auto.json": None,  # the old gather spelling alone: DeepSpeed's alias
    "llamafactory_ds_z0_config.json": None,
    "llamafactory_ds_z3_config.json": None,
    # unfilled placeholders, every one named in one line (was two of seven, with "write the number without quotes")
    "megatron_ds_heredoc_shell_vars.json": "train_batch_size ($GLOBAL_BATCH), train_micro_batch_size_per_gpu "
                                           "($MICRO_BATCH), zero_optimization.stage (${ZERO_STAGE}): unfilled "
                                           "template placeholders",
    "megatron_ds_moe_elastic_checkpoint_bf16.json": None,
    "megatron_ds_prescale_predivide_comm_dtype_fp32.json": None,  # the predivide factor unused: a note says so
    "megatron_ds_template_placeholders.json": "zero_optimization.stage (ZERO_STAGE), prescale_gradients "
                                              "(PRESCALE_GRAD), fp16.enabled (CONFIG_FP16_ENABLED), bf16.enabled "
                                              "(CONFIG_BF16_ENABLED): unfilled template placeholders",
    "openrlhf_eval_ref_zero3_offload_param.json": None,
    "trl_ppo_ref_model_zero3_no_batch.json": None,  # the micro batch alone
    "ulysses_seq_parallel_comm_dtype_fp32_sp1.json": None,  # sequence_parallel_size 1: the Ulysses dtype unused, noted
})
CHECKED_ONLY |= {  # round 12: each trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand (as written)
    "accelerate_docs_zero2_torch_adam_warmupdecay.json", "accelerate_docs_zero3_offload_gather_auto.json",
    "accelerate_plugin_dump_nvme_path_null.json", "axolotl_zero2_bf16_immediate_grad_update_false.json",
    "axolotl_zero3_bf16.json", "ds_old_fp16_auto_cast_bf16_on.json", "dschat_eval_config_stage0_offload_none.json",
    "hf_trainer_zero3_legacy_gather_fp16_only_auto.json", "llamafactory_ds_z0_config.json",
    "llamafactory_ds_z3_config.json", "megatron_ds_moe_elastic_checkpoint_bf16.json",
    "megatron_ds_prescale_predivide_comm_dtype_fp32.json", "openrlhf_eval_ref_zero3_offload_param.json",
    "trl_ppo_ref_model_zero3_no_batch.json", "ulysses_seq_parallel_comm_dtype_fp32_sp1.json"}
EXPECT.update({  # round 13 (tests/unit/test_ds_realworld13.py)
    "lightning_strategy_zero3_offload_dump.json": None,  # aio.thread_count with no NVMe: the section is noted unused
    "lightning_strategy_nvme_aio_thread_count.json": "aio.thread_count: 8, which DeepSpeed 0.19 no longer reads",
    "zero3_nvme_aio_quoted_values.json": "aio.block_size: a positive whole number, file says '1048576'",
    "lightning_fp16_hysteresis_zero.json": "fp16.hysteresis: 0, and DeepSpeed's dynamic loss scaler lowers the scale "
                                           "only when its hysteresis count is 1",
    "openrlhf_zero2_compile_deepcompile_false.json": None,  # DeepCompile off, autotp_size 1, stage-3 "auto"s noted
    "hf_2021_zero3_cpu_offload_flags.json": None,  # cpu_offload_use_pin_memory: unread by DeepSpeed 0.19, noted
    "zero2_cpu_offload_use_pin_memory_false.json": "zero_optimization.cpu_offload_use_pin_memory: false, which "
                                                   "DeepSpeed 0.19 no longer reads",
    "checkpoint_flags_quoted_false.json": "checkpoint.use_node_local_storage: file says 'false' in quotes",
    "checkpoint_tag_validation_boolean.json": "checkpoint.tag_validation: false, not a mode",
    "vocabulary_size_quoted.json": "vocabulary_size: file says '50257', not a number",
    "communication_data_type_auto.json": "communication_data_type: \"auto\" is not a value dstrain can fill",
    "torch_autocast_safe_modules_short_names.json": "torch_autocast.lower_precision_safe_modules: 'Linear' not "
                                                    "importable as package.Class",
    "zeropp_quantized_weights_torch_autocast.json": "zero_optimization.zero_quantized_weights: ZeRO++ quantized",
})
CHECKED_ONLY |= {  # round 13: each trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand (as written)
    "lightning_strategy_zero3_offload_dump.json", "openrlhf_zero2_compile_deepcompile_false.json",
    "hf_2021_zero3_cpu_offload_flags.json"}
EXPECT.update({  # round 14 (tests/unit/test_ds_realworld14.py)
    "tensorboard_csv_job_name_absolute.json": None,  # DeepSpeed's os.path.join drops output_path: noted, honoured
    "tensorboard_job_name_dotdot.json": "tensorboard.job_name: '../../tensorboard_runs/gpt_tiny_zero2' climbs out "
                                        "of output_path",
    "torch_autocast_bf16_both_enabled.json": None,  # bf16 weights with bfloat16 autocast on top, as DeepSpeed runs it
    "torch_autocast_no_dtype.json": None,  # torch's CPU default, bfloat16 (refused on GPUs: float16 without a scaler)
    "torch_autocast_dtype_fp32.json": None,  # autocast off on the CPU: an fp32 run, reported as fp32 (was bf16)
    # fp16 itself is refused on the CPU; on GPUs the pairing is (tests/unit/test_ds_realworld14.py)
    "torch_autocast_fp16_enabled.json": "fp16.enabled: fp16 does not run on the CPU accelerator",
    "torch_autocast_fp16_over_bf16.json": "torch_autocast.dtype: fp16 does not run on the CPU accelerator",
})
CHECKED_ONLY |= {  # round 14: trained 3 steps on 2 CPU ranks by hand (the absolute job_name pointed at a writable
    # folder for that run; as written it names a shared mount)
    "tensorboard_csv_job_name_absolute.json", "torch_autocast_bf16_both_enabled.json", "torch_autocast_no_dtype.json",
    "torch_autocast_dtype_fp32.json"}
EXPECT["checkpoint_parallel_write_quoted.json"] = ("checkpoint.parallel_write.pipeline_stage: file says \"true\", and "
                                                   "DeepSpeed's parser accepts only true or false")
EXPECT.update({  # round 14: keys DeepSpeed reads only inside a section (the close-match hint named the wrong key)
    "gradient_accumulation_dtype_top_level.json": "unknown top-level key 'gradient_accumulation_dtype': DeepSpeed "
                                                  "reads the gradient-accumulation dtype only as "
                                                  "data_types.grad_accum_dtype",
    "zero_keys_flattened_top_level.json": "unknown top-level key 'overlap_comm': a zero_optimization key",
})
EXPECT["comms_logger_prof_all_false_no_ops.json"] = None  # trains; a note says the logger times no op
CHECKED_ONLY.add("comms_logger_prof_all_false_no_ops.json")  # round 14: trained 3 steps on 2 CPU ranks by hand
EXPECT.update({  # round 15: other tools' configs given as a training DeepSpeed JSON (dstrain.engine.ds_foreign)
    # DeepSpeed-inference / MII keys: the training engine ignores them silently (an fp16 "dtype" trains in fp32)
    "mii_inference_config_dtype_fp16.json": "unknown top-level key 'dtype': a DeepSpeed-inference key "
                                            "(deepspeed.init_inference / MII), which training never reads",
    # training's TPTrainingConfig forbids tp_size: DeepSpeed's parser line, shown bare before
    "inference_tensor_parallel_tp_size_one.json": "tensor_parallel.tp_size: DeepSpeed-inference's tensor-parallel keys",
    # a string "checkpoint" stopped DeepSpeed's parser on "'str' object has no attribute 'get'", shown bare before
    "inference_checkpoint_json_path.json": "checkpoint: file says 'checkpoints/llama/ds_inference_config.json', "
                                           "DeepSpeed-inference's checkpoint path",
    "verl_actor_critic_nested_deepspeed_config.json": "top-level key 'actor' holds a DeepSpeed config two levels down, "
                                                      "at actor.deepspeed_config",
    "determined_hyperparameters_overwrite_args.json": "unknown top-level key 'overwrite_deepspeed_args': Determined's "
                                                      "overrides",
    # DeepSpeed clips at max_norm True, i.e. 1.0 (refused as not a number before); false is no clipping
    "ray_train_gradient_clipping_true.json": None,
    # pinned: the autotuner's ds_config_optimal.json (its autotuning section popped), and 1e0 / 5e9 for integers,
    # 1 / 0 for booleans after a UTF-8 BOM, each read as DeepSpeed's hjson / pydantic read them
    "autotuning_ds_config_optimal.json": None,
    "floats_for_ints_and_int_flags_bom.json": None,
})
# round 15: SageMaker model parallelism's (smp) parameters beside a DeepSpeed config; its "pipeline": "interleaved"
# stopped DeepSpeed's parser ("'str' object has no attribute 'items'"), shown bare before
EXPECT["sagemaker_smp_pipeline_interleaved.json"] = ("pipeline: file says \"interleaved\", as SageMaker model "
                                                     "parallelism (smp) writes its pipeline mode")
# round 15: DeepSpeed's WarmupLR starts at warmup_min_lr unchecked: a negative one trained uphill (passed before)
EXPECT["warmup_lr_negative_min_lr.json"] = "scheduler.params.warmup_min_lr: must be a number >= 0 or \"auto\""
CHECKED_ONLY |= {  # round 15: trained 3 steps on 2 CPU ranks by hand
    "ray_train_gradient_clipping_true.json", "autotuning_ds_config_optimal.json",
    "floats_for_ints_and_int_flags_bom.json"}
EXPECT.update({  # round 16 (tests/unit/test_ds_realworld16.py): LLaMA-Factory's, axolotl's offload, Alpaca's, FastChat's
    # DeepSpeedConfig's attribute names as keys, both turning nothing on: noted (was refused as unknown keys)
    "llamafactory_ds_z3_offload_monitor_config.json": None,
    # LLaMA-Factory's ALST section: named with --parallel.sp=4 (was "did you mean 'sequence_parallel_size'?")
    "llamafactory_ds_z3_alst_sequence_parallel.json": "unknown top-level key 'sequence_parallel': LLaMA-Factory's "
                                                      "sequence-parallel (ALST / Ulysses) section",
    "llamafactory_ds_z3_fp8_section.json": "unknown top-level key 'fp8': DeepSpeed 0.19 has no fp8 training section",
    # AutoTP refused as before; its "_comment" is a comment (was "unknown top-level key '_comment' (did you mean
    # 'comet'?)")
    "llamafactory_ds_z2_autotp_comment_key.json": "tensor_parallel: DeepSpeed's AutoTP is not used by dstrain",
    "llamafactory_ds_z3_partial_offload.json": None,
    "llamafactory_ds_z1_gaudi_throughput_timer.json": None,
    "llamafactory_sweep_z3_grad_accum_bf16_granularity_16.json": None,
    "llamafactory_z3_fp16_auto_cast_wall_clock.json": None,
    "axolotl_zero3_bf16_cpuoffload_all.json": None,
    "axolotl_zero3_bf16_cpuoffload_params.json": None,
    "alpaca_default_offload_opt_param.json": None,
    "fastchat_deepspeed_config_s3_fp16_auto.json": None,
    "fastchat_lora_s2_torch_adam_offload.json": None,
    "fastchat_deepspeed_config_s2_offload_only.json": None,
})
CHECKED_ONLY |= {  # round 16: each trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand (as written)
    "llamafactory_ds_z3_offload_monitor_config.json", "fastchat_lora_s2_torch_adam_offload.json",
    "llamafactory_sweep_z3_grad_accum_bf16_granularity_16.json"}
EXPECT.update({  # round 17 (tests/unit/test_ds_realworld17.py): DeepSpeedExamples' QANet, GAN, pipeline and Megatron-LM
    # ZeRO-3 / ZeRO-Infinity configs, DeepSpeed's autotuner template and test config, Accelerate's test configs,
    # InternVL's, DeepSpeed-Chat's MixZ++ config, a ChatGLM LoRA recipe's and ms-swift's ZeRO-2 (source project and
    # path each)
    # DeepSpeedExamples QANet-Pytorch/ds_bsz512_1cycle.json: OneCycle with stair counts over Adam betas (0.8, 0.999)
    "qanet_onecycle_stair_counts_adam.json": None,
    "qanet_short_warmuplr_batch_only.json": None,  # QANet-Pytorch/short_deepspeed_warmup.json: no optimizer block
    # DeepSpeed deepspeed/autotuning/config_templates/template_zero3.json: ZeRO-3 keys alone, sub_group_size 1e12
    "autotuning_template_zero3_sub_group_1e12.json": None,
    "gan_adam_betas_half_batch_only.json": None,  # DeepSpeedExamples gan/gan_deepspeed_config.json
    # Accelerate tests/deepspeed/ds_config_zero2_model_only.json: gradient_accumulation_steps 1 beside "auto"s
    "accelerate_tests_zero2_model_only_grad_accum_one.json": None,
    "pipeline_parallelism_adam_batch_256_micro_8.json": None,  # DeepSpeedExamples pipeline_parallelism/ds_config.json
    # InternVL internvl_chat/zero_stage1_config_wo_opt.json: no optimizer block, WarmupDecayLR all "auto"
    "internvl_zero1_wo_opt_warmupdecay_all_auto.json": None,
    # InternVL internvl_chat/zero_stage3_config_100b_1e7_offload.json: ZeRO-3 offload with 1e7 buckets, auto_cast
    "internvl_zero3_100b_offload_1e7_buckets.json": None,
    # DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_infinity_config.json: its misspelt
    # stage3_param_persitance_threshold named with the spelling DeepSpeed reads, beside fp16 and NVMe on the CPU
    "megatron_zero3_infinity_nvme_persitance_typo.json": "zero_optimization.stage3_param_persitance_threshold: "
                                                         "unknown key (did you mean "
                                                         "'stage3_param_persistence_threshold'?)",
    # Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config_release.json: DeepSpeed 0.3's cpu_offload_params
    "megatron_zero3_release_cpu_offload_params.json": "zero_optimization.cpu_offload_params: unknown key",
    # Megatron-LM/model_size_test_with_acumulated_grad/ds_zero-offload_150B_config.json: "comm_overlap" (was an
    # unknown key with no hint: difflib does not match words in another order)
    "megatron_zero_offload_150b_comm_overlap.json": "zero_optimization.comm_overlap: unknown key (did you mean "
                                                    "'overlap_comm'?)",
    # DeepSpeed deepspeed/autotuning/tests/ds_config.json: the tuning space's lists (was "Input should be a valid
    # boolean, file says [False]", Python's spelling, with no fix)
    "autotuning_tests_tuning_space_lists.json": "zero_optimization.overlap_comm: file says [false], a list where "
                                                "DeepSpeed's parser takes one value",
    # a ChatGLM-6B LoRA recipe's ZeRO-2 (as Chinese-LLaMA-Alpaca's): min_loss_scale 1e-10, which DeepSpeed 0.19's
    # integer field rejects even with fp16 "auto" (was pydantic's message alone)
    "chatglm_lora_zero2_min_loss_scale_fraction.json": "fp16.min_loss_scale: file says 1e-10, a fraction where "
                                                       "DeepSpeed's parser takes a whole number (it rejects it); "
                                                       "write a whole number, such as 1",
    # Accelerate tests/deepspeed/ds_config_zero3_model_only.json: train_batch_size 1 on 2 ranks (now with the fix)
    "accelerate_tests_zero3_model_only_batch_one.json": "train_batch_size 1 is not a multiple of the 2 data-parallel "
                                                        "ranks (DeepSpeed splits it evenly over them and stops at "
                                                        "start-up); set it to a multiple of 2 or \"auto\"",
    # DeepSpeed-Chat's get_train_ds_config with --enable_mixed_precision_lora (MixZ++), as it returns it on 8 GPUs
    "dschat_mixz_quantized_nontrainable_hpz.json": "zero_optimization.zero_quantized_nontrainable_weights: ZeRO++ "
                                                   "quantized",
    # DeepSpeedExamples claude_tutorials/annotated_configs/zero3_cpu_offload_annotated.json: // comments, and
    # offload_param.buffer_size "auto", DeepSpeed's 1e8 (was refused: "DeepSpeed itself keeps the text"; it trains on
    # one rank now); train_batch_size 1 on 2 ranks
    "dsexamples_annotated_zero3_cpu_offload_comments_auto.json": "train_batch_size 1 is not a multiple of the 2 "
                                                                 "data-parallel ranks",
    # DeepSpeedExamples benchmarks/autosp/configs/autosp_config.json: DeepSpeed reads its batch keys on 2 GPUs
    # with sequence_parallel_size 2 as 1 data-parallel rank (was "batch keys disagree among themselves", alone:
    # the sequence-parallel and compile refusals went unsaid)
    "dsexamples_autosp_deepcompile_sequence_parallel.json": "sequence_parallel_size: dstrain splits sequences "
                                                            "itself; remove the key and use --parallel.sp=2",
    # ms-swift examples/omega17_exp/ds_config_zero2.json: DeepSpeed's activation-checkpointing block
    "ms_swift_zero2_activation_checkpointing.json": "activation_checkpointing.partition_activations: DeepSpeed's "
                                                    "activation-checkpointing block only acts on models that call "
                                                    "deepspeed.checkpointing",
})
CHECKED_ONLY |= {  # round 17: each trained 3 steps on 2 CPU ranks by its slow run (-m slow) before joining this set;
    # the QANet pair and InternVL's ZeRO-3 offload stay in the slow runs
    "autotuning_template_zero3_sub_group_1e12.json", "gan_adam_betas_half_batch_only.json",
    "accelerate_tests_zero2_model_only_grad_accum_one.json", "pipeline_parallelism_adam_batch_256_micro_8.json",
    "internvl_zero1_wo_opt_warmupdecay_all_auto.json"}
EXPECT.update({  # round 18 (tests/unit/test_ds_realworld18.py): configs generated in code, as users paste them
    # OpenRLHF openrlhf/utils/deepspeed/deepspeed_utils.py get_train_ds_config(offload=False, adam_offload=False,
    # stage=3, zpg=1, overlap_comm=True, use_ds_universal_ckpt=True): DeepSpeed would load every checkpoint as universal
    "openrlhf_train_z3_load_universal_overlap.json": "checkpoint.load_universal: DeepSpeed would load every "
                                                     "checkpoint as a universal one",
    # get_train_ds_config(offload=True, adam_offload=True, stage=3, zpg=1, grad_accum_dtype="fp32")
    "openrlhf_train_z3_offload_grad_accum_fp32_zpg1.json": None,
    # get_train_ds_config(offload=False, adam_offload=False, stage=2, zpg=1, precision="fp32"): bf16 and fp16 false
    "openrlhf_train_z2_precision_fp32_neither_on.json": None,
    # get_eval_ds_config(offload=True, stage=3): no optimizer, no batch keys, stage-3 "auto"s
    "openrlhf_eval_z3_offload_stage3_autos.json": None,
    # get_eval_ds_config(offload=False): its default stage 0 beside the stage-3 "auto"s (noted unused)
    "openrlhf_eval_z0_stage3_autos_unused.json": None,
    # get_train_ds_config(offload=False, adam_offload=False, stage=2, zpg=1, tensor_parallel_size=2)
    "openrlhf_train_z2_autotp_size_2.json": "tensor_parallel: DeepSpeed's AutoTP is not used by dstrain",
    # DeepSpeedExamples applications/DeepSpeed-Chat/dschat/utils/ds_utils.py get_train_ds_config(offload=False,
    # dtype="bf16", stage=3): the legacy "bfloat16" section, batch 32 / micro 4, memory_efficient_linear false
    "dschat_train_bfloat16_z3_memory_efficient_linear.json": None,
    # get_train_ds_config(offload=True, dtype="bf16", stage=2, enable_tensorboard=True, tb_path="step1_tensorboard",
    # tb_name="step1_model"): --offload at stage 2 writes offload_param, which DeepSpeed ignores below stage 3
    "dschat_train_bfloat16_z2_offload_tensorboard.json": "zero_optimization.offload_param: parameter offload is only "
                                                         "valid with ZeRO stage 3",
    # get_train_ds_config(offload=False, dtype="bf16", stage=3, enable_hybrid_engine=True)
    "dschat_train_bfloat16_z3_hybrid_engine_on.json": "hybrid_engine.enabled: the hybrid engine is for "
                                                      "DeepSpeed-Chat's RLHF loop",
    # get_eval_ds_config(offload=True, dtype="bf16", stage=3): the reward / reference model's config
    "dschat_eval_bfloat16_z3_offload.json": None,
    # IDEA-Research/hana config/deepspeed.py deepspeed_config: WarmupLR with last_batch_iteration -1 and no
    # optimizer block, fp16 on ZeRO-2 offload, an activation-checkpointing block of falses (number_checkpoints false)
    "hana_warmuplr_fp16_offload_checkpoint_flags.json": "fp16.enabled: fp16 does not run on the CPU accelerator",
    # HenryCai11/LLM-Self-Control self_control/prefix_control/configs/deepspeed.py deepspeed_config: a
    # sparse_attention section beside AdamW's torch_adam / adam_w_mode
    "self_control_sparse_attention_torch_adam.json": "top-level key 'sparse_attention' is no longer supported",
    # GPT-NeoX configs/bf16_125M.yml, its DeepSpeed parts pasted as JSON (optimizer, zero_optimization, micro batch,
    # gradient_clipping, steps_per_print, wall_clock_breakdown) with NeoX's own precision / fp32_allreduce beside them
    # (was "unknown top-level key 'precision'; DeepSpeed would silently ignore it", with no fix)
    "gpt_neox_bf16_125m_precision_fp32_allreduce.json": "unknown top-level key 'precision': file says 'bfloat16', "
                                                        "GPT-NeoX's precision setting",
    # the same with the fp16 section of GPT-NeoX tests/model/test_model_train.py's bf16 case ("type": "bfloat16"), as
    # that test puts it in place of "precision" (was "fp16.type: unknown key; DeepSpeed rejects it")
    "gpt_neox_test_fp16_type_bfloat16.json": "fp16.type: file says 'bfloat16', GPT-NeoX's way of choosing the "
                                             "precision in the fp16 section",
})

# Round 19: the scripts/zero2.json / zero3.json files of LLaVA-derived multimodal projects, each with a value of its
# own beside LLaVA's (the file path is scripts/<name> in each repository).
EXPECT.update({
    # NVIDIA/audio-flamingo scripts/zero3.json: stage3_prefetch_bucket_size 0 (no prefetching), no gradient_clipping
    "audio_flamingo_zero3_prefetch_bucket_zero.json": None,
    # cambrian-mllm/cambrian scripts/zero2.json: gradient_clipping 1.0 written after the ZeRO block, stage-3
    # sub_group_size at stage 2 (noted unused)
    "cambrian_zero2_gradient_clipping_one.json": None,
    # IDEA-CCNL/Fengshenbang-LM fengshen/examples/pretrain_erlangshen/pretrain_erlangshen_1.3B.sh, its heredoc
    # ds_config: fp16 with initial_scale_power 32, Adam under a flat WarmupLR (min = max 1e-6), flops_profiler on at
    # step 25, zero_allow_untested_optimizer false
    "fengshen_erlangshen_bert_warmuplr_flat_flops_profiler.json": "fp16.enabled: fp16 does not run on the CPU "
                                                                   "accelerator",
    # lucadiliello/transformers-framework transformers_framework/utilities/strategy.py: the config dict of its
    # 'deepspeed_stage_2_offload_no_error' DeepSpeedStrategy (the project patches DeepSpeed's
    # get_dynamic_loss_scale_args to pass raise_error_at_min_scale); was "fp16.raise_error_at_min_scale: unknown key;
    # DeepSpeed rejects it", with no fix and nothing on what the key did
    "lightning_tf_framework_fp16_raise_error_at_min_scale.json": "fp16.raise_error_at_min_scale: an argument of "
                                                                 "DeepSpeed's dynamic loss scaler",
    # PKU-YuanGroup/MoE-LLaVA scripts/zero3.json: fp16 "auto" with loss_scale_window 100
    "moe_llava_zero3_loss_scale_window_100.json": None,
    # CircleRadon/Osprey scripts/zero3.json: stage3_max_live_parameters / max_reuse_distance 1e8
    "osprey_zero3_live_reuse_1e8.json": None,
    # AIDC-AI/Ovis scripts/zero3.json: fp16 off beside bf16 "auto", gradient_clipping "auto"
    "ovis_zero3_fp16_off_bf16_auto.json": None,
    # TinyLLaVA/TinyLLaVA_Factory scripts/zero2.json: ignore_unused_parameters true at stage 2
    "tinyllava_zero2_ignore_unused_parameters.json": None,
    # PKU-YuanGroup/UniWorld-V1 scripts/zero2.json: allgather / reduce buckets of 536870912 elements, no clipping
    "uniworld_zero2_512mib_buckets.json": None,
    # AoyuQC/VILA (a fork of NVlabs/VILA) scripts/zero3.json: ZeRO-3 with CPU optimizer offload and a disabled
    # flops_profiler whose output_file is null
    "vila_zero3_offload_opt_flops_profiler_off.json": None,
})

# Round 20 (tests/unit/test_ds_realworld20.py): sources not covered before: InternLM/xtuner's DeepSpeed configs,
# LianjiaTech/BELLE's, OptimalScale/LMFlow's, QwenLM/Qwen's and deepseek-ai/DeepSeek-Coder's finetune configs,
# yangjianxin1/Firefly's TrainingArguments files, DeepSpeedExamples' newer training/ configs (OPSD, expert parallel).
EXPECT.update({
    # xtuner xtuner/configs/deepspeed/deepspeed_zero2_offload.json: fp16 with optimizer offload, zero_force_ds_cpu_
    # optimizer false; accepted on GPUs (tests/unit/test_ds_realworld20.py)
    "xtuner_zero2_offload_fp16_force_ds_cpu_false.json": "fp16.enabled: fp16 does not run on the CPU accelerator",
    # xtuner xtuner/configs/deepspeed/deepspeed_zero3.json: transformers' "low_cpu_mem_usage": false at the top level,
    # refused as an unknown key with no fix before; now a note (accepted on GPUs), the CPU refuses its fp16 only
    "xtuner_zero3_low_cpu_mem_usage_key.json": "fp16.enabled: fp16 does not run on the CPU accelerator",
    # xtuner examples/deepspeed_config.json: AdamW at lr 1e-8 (xtuner's optimizer replaces it; dstrain trains the
    # file's), wall_clock_breakdown on, prescale_gradients false, bf16
    "xtuner_example_zero2_adamw_wall_clock_bf16.json": None,
    # BELLE train/configs/deepspeed_config_stage3_flops_profile.json: the profiler at step 50 in a 3-step run
    "belle_zero3_offload_flops_profile_step_50.json": "flops_profiler.profile_step: 50, and the run takes 3 steps",
    # BELLE train/configs/deepspeed_config_ppo.json: AdamW with torch_adam / adam_w_mode at stage 3, fp16 off with
    # its loss-scale keys, stage-1/2 allgather_bucket_size (noted unused)
    "belle_ppo_zero3_torch_adamw_bf16.json": None,
    # BELLE train/configs/deepspeed_config_stage3_inference.json: fp16, every stage-3 threshold 0
    "belle_zero3_inference_fp16_zero_thresholds.json": "fp16.enabled: fp16 does not run on the CPU accelerator",
    # LMFlow configs/ds_config_chatbot.json: steps_per_print 20000000000000000, a disabled comms_logger
    "lmflow_zero3_chatbot_steps_per_print_2e16.json": None,
    # LMFlow configs/ds_config_multimodal.json: bf16 and fp16 both off (fp32), no ZeRO section
    "lmflow_multimodal_fp32_comms_logger_off.json": None,
    # LMFlow configs/archive/ds_config_zero3_for_eval.json: ZeRO-3 with both offloads, no optimizer block
    "lmflow_zero3_eval_offload_both_bf16.json": None,
    # Qwen finetune/ds_config_zero2.json: offload_optimizer "none" with pin_memory, every value "auto"
    "qwen_finetune_zero2_offload_none_all_auto.json": None,
    # DeepSeek-Coder finetune/configs/ds_config_zero3.json: WarmupCosineLR with warmup_min_ratio 0.1, both offloads
    "deepseek_coder_zero3_offload_cosine_warmup_min_ratio.json": None,
    # DeepSpeedExamples training/expert_parallel/configs/ds_zero3_leaf_qwen3_5.json: 1000 scheduler steps (refused
    # for a 3-step run, with the fix); its Qwen3.5-MoE leaf class, absent from the run's model, is noted (was silent)
    "dsexamples_expert_parallel_zero3_leaf_cosine.json": "scheduler.params.total_num_steps: file says 1000, run "
                                                         "gives 3",
    # DeepSpeedExamples training/opsd/configs/opsd_hybrid_engine.json: the app's own config, whose deepspeed_config
    # names the DeepSpeed file (was a line per key, and "as Determined's hyperparameters do")
    "dsexamples_opsd_app_config_deepspeed_config_path.json": "deepspeed_config: file says 'configs/ds_zero3.json': "
                                                             "this is a training script's own settings file",
    # Firefly train_args/sft/full/qwen-7b-sft-full.json: TrainingArguments with "deepspeed" naming the DeepSpeed
    # file (was 26 lines: one per key, with close matches such as train_file -> train_batch_size)
    "firefly_training_args_deepspeed_path.json": "deepspeed: file says './train_args/ds_z3_config.json': this is a "
                                                 "training script's own settings file",
})

# Round 21 (tests/unit/test_ds_realworld21.py): sources not covered before: an `accelerate config` file in its JSON
# form, CogVideo's SAT training config, PKU-YuanGroup/Open-Sora-Plan's Accelerate DeepSpeed JSON, turbo-llm/turbo-
# alignment's sequence-parallel test config, a generated ZeRO-3 config with a bf16 loss-scale window, DeepSpeed's
# docs' NVMe parameter offload, and DeepSpeed's communication switches written at the stage that ignores them.
EXPECT.update({
    # an `accelerate config` file (JSON form) with its DeepSpeed-plugin settings and a pasted zero_optimization block
    # inline: was 13 lines, one per Accelerate key, and "move its keys to the top level" (which left zero_stage /
    # zero3_init_flag unread); now one line with the DeepSpeed JSON its settings stand for
    "accelerate_config_json_inline_deepspeed_config.json": "deepspeed_config: this is an Accelerate config file",
    # zai-org/CogVideo sat/configs (the 5B's bf16 variant of sft.yaml's deepspeed section, as JSON): SAT's own
    # FusedEmaAdam as the optimizer type (was refused with no fix)
    "cogvideo_sat_zero2_bf16_fused_ema_adam.json": "optimizer.type: 'sat.ops.FusedEmaAdam' is neither one of "
                                                   "DeepSpeed's optimizers nor a torch.optim class (a module path to "
                                                   "a project's own class",
    # a ZeRO-3 offload config generated in code with "bf16": {"enabled": true, "loss_scale_window": 250} (fp16's
    # template key kept): DeepSpeed's bf16 section rejects it (was "unknown key" with no fix)
    "generated_zero3_offload_bf16_loss_scale_window.json": "bf16.loss_scale_window: file says 250, a key of fp16's "
                                                           "dynamic loss scaling",
    # Open-Sora-Plan scripts/accelerate_configs/zero2.json: communication_data_type fp32, 512 Mi-element buckets,
    # everything else "auto"
    "opensora_plan_zero2_comm_fp32_512mi_buckets.json": None,
    # turbo-alignment tests/sequence_parallel/consts.py DEEPSPEED_CONFIG: batch 1 for one rank, no optimizer block,
    # allgather_partitions / allgather_bucket_size at stage 3 (noted unused on one rank)
    "turbo_alignment_sp_zero3_allgather_partitions_no_opt.json": "batch keys disagree among themselves: "
                                                                 "train_batch_size 1",
    # DeepSpeed's docs' ZeRO-Infinity example: offload_param to NVMe at /local_nvme (no async-io kernel on the CPU)
    "dsdocs_zero3_nvme_param_offload.json": "zero_optimization.offload_param.device: NVMe offload needs DeepSpeed's "
                                            "async_io kernel",
    # stage 3 with the stage-1/2 switches (allgather_partitions false, allgather_bucket_size, round_robin_gradients)
    # beside reduce_scatter / contiguous_gradients false: allgather_partitions was not named with the others
    "zero3_stage12_comm_switches_round_robin.json": None,
    # stage 2 with reduce_scatter false (all-reduce, where DeepSpeed honours gradient_predivide_factor),
    # prescale_gradients false, communication_data_type fp32 over bf16
    "zero2_predivide_reduce_scatter_false_comm_fp32.json": None,
})

# Round 22 (tests/unit/test_ds_realworld22.py): sources not covered before: DeepSpeedExamples' CIFAR-10 script's
# in-code config, a protein language model (ESM) fine-tuning script's in-code config, a project scaffolding
# generator's ds_config.json for two GPUs, Megatron-DeepSpeed's MoE template as its run scripts fill it, and a
# language-model pruning example's ZeRO-3 config with Apex's opt_level in its fp16 block.
EXPECT.update({
    # DeepSpeedExamples training/cifar/cifar10_deepspeed.py get_ds_config() with --dtype bf16 --stage 0: a disabled
    # fp16 block with fp16_master_weights_and_grads false, "cpu_offload": false (noted as DeepSpeed reading it as
    # offload_optimizer "cpu" before; false sets no offload)
    "dsexamples_cifar_bf16_stage0_cpu_offload_false.json": None,
    # an ESM fine-tuning script's ds_config: fp32 (bf16 and fp16 off), OneCycle with cycle_min_lr above cycle_max_lr,
    # a disabled comms_logger, offload_optimizer "none" at stage 0
    "esm_finetune_onecycle_fp32_offload_none.json": None,
    # a scaffolding generator's ds_config.json (json.dump of a dict, 2 GPUs): train_batch_size 32 beside micro 16 x
    # accumulation 4, fp16 and bf16 both on, lr / warmup_min_lr / warmup_max_lr as text; check_ds_file named only the
    # two quoted numbers values_from_file reads, and never warmup_min_lr (DeepSpeed's WarmupLR: TypeError)
    "generated_two_gpu_zero2_quoted_lrs_batch_disagree.json": "batch keys disagree among themselves: "
                                                              "train_batch_size 32 != train_micro_batch_size_per_gpu "
                                                              "16 x gradient_accumulation_steps 4",
    # Megatron-DeepSpeed examples_deepspeed/MoE/ds_config_gpt_TEMPLATE.json as ds_pretrain_gpt_*_MoE*.sh fill it
    # (CL_ENABLED false): DeepSpeed 0.19 stops on the legacy curriculum key even when off; the fix said to move it
    # to data_efficiency's curriculum, which dstrain refuses in turn; now: off, remove it, nothing changes
    "megatron_ds_moe_template_filled_curriculum_off.json": "top-level key 'curriculum_learning' is no longer "
                                                           "supported",
    # a language-model pruning example's README (snip-momentum pruning under Accelerate), its
    # config/zero_stage3_config.json: Apex's "opt_level": "O2" in the fp16 block (was "unknown key" with no why),
    # WarmupDecayLR with warmup_type "cosine", torch_adam / adam_w_mode; the CPU refuses its fp16 too
    "pruning_example_zero3_fp16_opt_level_cosine_warmup.json": "fp16.opt_level: file says \"O2\", Apex AMP's "
                                                               "optimisation level",
})

# Round 24 (tests/unit/test_ds_realworld24.py): sources not covered before: kohya-ss sd-scripts' DeepSpeed plugin
# dicts (Accelerate's dump with the batch it computes), a ColossalAI / torch.amp migrant's fp16 block, DeepSpeed's
# ZeRO++ tutorial block with hpZ alone (quantization off), DeepSpeed-Chat step 2's generated reward-model config.
EXPECT.update({
    # sd-scripts' prepare_deepspeed_plugin with bf16: train_batch_size = micro x accumulation x ranks, a stage-3 key
    # at stage 2 (noted), zero_allow_untested_optimizer for its own optimizers
    "kohya_sdscripts_zero2_bf16_accelerate_dump.json": None,
    # the same with fp16: sd-scripts sets initial_scale_power 0 (a starting scale of 1); the CPU refuses fp16, a GPU
    # takes it (tests/unit/test_ds_realworld24.py)
    "kohya_sdscripts_zero2_fp16_initial_scale_power_zero.json": "fp16.enabled: fp16 does not run on the CPU",
    # GradScaler's / ColossalAI's initial_scale, growth_interval, min_scale, growth_factor, backoff_factor in the
    # fp16 block and ColossalAI's overlap_communication: each was "unknown key; DeepSpeed rejects it" (min_scale and
    # initial_scale with a misleading "did you mean"); now each names DeepSpeed's key with the value converted
    "colossalai_migrant_zero2_fp16_gradscaler_keys.json": "fp16.initial_scale: file says 65536, PyTorch "
                                                          "GradScaler's / ColossalAI's name",
    # the ZeRO++ tutorial's block with hpZ 16 and both quantizations off, on 2 ranks (hpZ groups min(16, 2))
    "dsdocs_zeropp_tutorial_hpz_only_multinode.json": None,
    # DeepSpeed-Chat get_train_ds_config(dtype="bf16", stage=2) for step 2: "bfloat16", stage-3 keys at stage 2,
    # hybrid_engine off, tensorboard off, train_batch_size 64 over micro 8 (accumulation 4 on 2 ranks)
    "dschat_step2_reward_zero2_bfloat16_stage3_keys_hybrid_off.json": None,
})

# Round 25 (tests/unit/test_ds_realworld25.py): DeepSpeed's first flops-profiler README (a boolean section, top-level
# profile_* keys, start_step / end_step), an optimizer block with params and no type (a Transformers notes page's
# "Configuration with Trainer"), DeepSpeedExamples' variable batch size and lr (dynamic batching), a Transformers
# NVMe issue's aio block inside zero_optimization, and an empty scheduler block (written for the round: the shape a
# YAML dump of "scheduler: {}" gives).
EXPECT.update({
    # "flops_profiler": true with profile_start_step / profile_end_step / profile_depth / profile_top_num beside it:
    # check_ds_file and the launch checks stopped on an AttributeError (a traceback); now one line each, with
    # DeepSpeed 0.19's key and the value moved
    "dsdocs_flops_profiler_readme_v1_true_top_level_steps.json": "flops_profiler: must be an object (a section of "
                                                                 "keys), file says true",
    # the same README's Megatron example: start_step / end_step were "unknown key", start_step without a hint
    "dsdocs_flops_profiler_readme_megatron_start_end_step.json": "flops_profiler.start_step: the flops profiler's key "
                                                                 "in DeepSpeed's first profiler; DeepSpeed 0.19 reads "
                                                                 "it as flops_profiler.profile_step",
    # {"params": {"lr": "auto"}} with no type: was accepted, then every rank stopped at the first backward (DeepSpeed
    # builds no optimizer from a typeless block)
    "hf_trainer_notes_optimizer_params_without_type.json": "optimizer.type: no \"type\" (the block has params)",
    # variable_batch_size_and_lr_example.py's config: the refusal now names dynamic batching among what never runs
    "dsexamples_variable_batch_size_and_lr_dynamic_batching.json": "data sampling (curriculum, dynamic batching) "
                                                                   "never runs",
    # the same block left on under data_efficiency false: DeepSpeed parses it anyway; was accepted (fixed batches)
    "dsexamples_dynamic_batching_left_on_data_efficiency_off.json": "data_efficiency.data_sampling.dynamic_batching."
                                                                    "enabled: DeepSpeed reads it whatever",
    # DeepSpeed issue 2721's block (NVMe switched to CPU here): aio inside zero_optimization was "unknown key"
    "hf_zero3_offload_aio_inside_zero_optimization.json": "zero_optimization.aio: a top-level key, which DeepSpeed "
                                                          "reads only at the top level",
    # "scheduler": {}: DeepSpeed builds no scheduler, the lr stays constant (trained by hand: 0.002 at each of 3 steps
    # on 2 CPU ranks); plan.txt said "the DeepSpeed JSON's scheduler block", now says the lr stays constant
    "yaml_dump_empty_scheduler_block.json": None,
    # DeepSpeed's first ZeRO form, "zero_optimization": true, with its top-level allgather_size, which DeepSpeed 0.19.8
    # still reads as that form's allgather_bucket_size (read_zero_config_deprecated): was refused as an unknown key
    # DeepSpeed "would silently ignore"; now moved into the section (trained by hand: 3 steps on 2 CPU ranks)
    "dsdocs_zero_bool_form_allgather_size.json": None,
    # a generated config's enabled flops profiler with its numbers in quotes: was accepted; DeepSpeed never profiles
    # (the step count never equals "1") or stops every rank at the profile step (TypeError in its printout)
    "generated_flops_profiler_quoted_numbers.json": "flops_profiler.profile_step: file says '1' in quotes",
})
CHECKED_ONLY |= {"yaml_dump_empty_scheduler_block.json", "dsdocs_zero_bool_form_allgather_size.json"}

# Round 26: DeepSpeed's reading of steps_per_print (a modulus: -1 logs every step, 0 stops rank 0), a ZeRO key whose
# default depends on the stage written "auto" (and bf16 / fp16 keys), and gradient clipping written among the optimizer's params.
EXPECT.update({
    # a negative steps_per_print runs in DeepSpeed (the step count modulo -1 is always 0): was refused; now a note
    "hf_zero2_steps_per_print_minus_one.json": None,
    # "overlap_comm": "auto": DeepSpeed drops "auto" and uses stage == 3; was refused as "not a value dstrain can fill"
    "openrlhf_style_zero3_overlap_comm_auto.json": None,
    # was "FusedAdam ... does not take it"; now one line that moves it to the top level with its value
    # a notebook's ZeRO-3 dict with fp16 off and "auto_cast": "auto": was refused as a value "DeepSpeed keeps as
    # text"; DeepSpeed's fp16 model drops "auto" (auto_cast false), so it is filled so, with a note
    "notebook_zero3_fp16_off_auto_cast_auto.json": None,
    "hf_notes_gradient_clipping_in_optimizer_params.json": "optimizer.params.gradient_clipping: gradient clipping is "
                                                           "a top-level key, not an optimizer param",
})
