"""The acceptance oracle of `colo-data verify` (`cd.verify`): short runs of a pipeline through
the real `Loader` with several host counts, checked for identical batches, each record once, in
the seed's order, and identical resumes (`verify.py`; a Grain pipeline's checks in
`verify_grain.py`, what both report in `checks.py`)."""
