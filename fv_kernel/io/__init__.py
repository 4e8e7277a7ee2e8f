"""Writing artifacts to files: MP4 (H.264), PNG frames, raw tensors, WAV."""

from fv_kernel.io.media import MediaError, encode_png, write_artifact, write_mp4, write_png_frames, write_tensor, write_wav

__all__ = ["MediaError", "encode_png", "write_artifact", "write_mp4", "write_png_frames", "write_tensor", "write_wav"]
