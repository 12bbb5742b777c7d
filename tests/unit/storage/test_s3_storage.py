"""S3Storage on answers a real S3 server gives but neither test server gives on demand (a per-key error in a
DeleteObjects response): botocore's Stubber stands in for the HTTP boundary. Everything else about S3 is
tested against real servers in tests/integration/test_s3_*.py."""

from __future__ import annotations

import pytest
from botocore.stub import Stubber

from SneppX_ALG import errors, storage
from SneppX_ALG.storage import s3_upload


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


def test_a_part_that_fails_on_an_upload_thread_is_a_storage_error(tmp_path) -> None:
    # A streamed shard's parts go up on a pool thread; the writer meets their failure later, from the part's
    # future. It must be the typed StorageError every other S3 failure is, not botocore's own exception.
    client = storage.make_s3_client(endpoint_url="http://127.0.0.1:9", region="us-east-1")  # never contacted
    store = storage.S3Storage("s3://bkt/run", client=client, staging_dir=str(tmp_path), part_bytes=5 << 20,
                              threads=1)
    upload = s3_upload.StreamingUpload(store, "run/step-000000001/shard-00000.snpx")
    with Stubber(client) as stub:
        stub.add_response("create_multipart_upload", {"UploadId": "u1"})
        stub.add_client_error("upload_part", service_error_code="InternalError", http_status_code=500)
        stub.add_response("abort_multipart_upload", {})
        with pytest.raises(errors.StorageError, match="upload part 2"):
            upload.append(bytes(5 << 20) * 3)  # part 1 is held back, part 2 goes up and fails
            upload.finish()
