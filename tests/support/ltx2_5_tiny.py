"""The tiny LTX-2.5 decoder, vocoder and scheduler configs both the family's checkpoint fixture
and its pipeline parity test build from (diffusers constructor keywords)."""

VAE = dict(latent_channels=8, block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
           decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 1, 1, 1),
           spatial_compression_ratio=32, temporal_compression_ratio=8)
AUDIO_VAE = dict(base_channels=8, ch_mult=(1, 2, 2), num_res_blocks=1, latent_channels=4, mel_bins=8)
VOCODER = dict(in_channels=16, hidden_channels=16, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
               resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]], bwe_in_channels=8, bwe_hidden_channels=8,
               bwe_upsample_kernel_sizes=[6, 4], bwe_upsample_factors=[6, 2], bwe_resnet_kernel_sizes=[3],
               bwe_resnet_dilations=[[1]], filter_length=16, hop_length=4, window_length=16, num_mel_channels=4,
               input_sampling_rate=16000, output_sampling_rate=48000)
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_image_seq_len=1024,
                 max_image_seq_len=4096, base_shift=0.95, max_shift=2.05, shift_terminal=0.1)
