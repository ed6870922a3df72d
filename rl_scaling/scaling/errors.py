"""The one error type of the scaling package: bad or insufficient input data."""


class ScalingDataError(ValueError):
    """Input the law cannot be fitted to; the message names the file, line/point and column at fault."""
