"""S3Storage on answers a real S3 server gives but neither test server gives on demand (a per-key error in a
DeleteObjects response): botocore's Stubber stands in for the HTTP boundary. Everything else about S3 is
tested against real servers in tests/integration/test_s3_*.py."""

from __future__ import annotations

import pytest
from botocore.stub import Stubber

from SneppX_ALG import errors, storage


def test_a_key_the_server_did_not_delete_fails_the_delete_and_the_step_stays_committed(tmp_path) -> None:
    # Real S3 answers DeleteObjects with 200 and lists the keys it could not delete (AccessDenied from a
    # bucket policy, InternalError, SlowDown) in Errors; boto3 raises nothing for them.
    client = storage.make_s3_client(endpoint_url="http://127.0.0.1:9", region="us-east-1")  # never contacted
    store = storage.S3Storage("s3://bkt/run", client=client, staging_dir=str(tmp_path))
    marker = "run/step-000000001/COMMITTED"
    with Stubber(client) as stub:
        stub.add_response("delete_objects",
                          {"Errors": [{"Key": marker, "Code": "AccessDenied", "Message": "Access Denied"}]},
                          {"Bucket": "bkt", "Delete": {"Objects": [{"Key": marker}], "Quiet": True}})
        with pytest.raises(errors.StorageError, match=f"{marker} \\(AccessDenied"):
            store.delete(1)  # and it stops there: the step's files are not deleted under a surviving marker
        stub.assert_no_pending_responses()
