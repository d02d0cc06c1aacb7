# Test fixture (read by test_rewards_serve_rm.py, never run): the flags of OpenRLHF 0.10.2's
# examples/scripts/serve_remote_rm.sh, pointed at posttrain's module; the test puts a tiny local
# score model in place of $RM_DIR (the example serves an 8B Llama-3 reward model from the hub).
python -m posttrain.cli.serve_rm \
    --reward.model_name_or_path "$RM_DIR" \
    --port 5000 \
    --ds.param_dtype bf16 \
    --ds.attn_implementation flash_attention_2 \
    --reward.normalize_enable \
    --data.max_len 8192 \
    --batch_size 16
