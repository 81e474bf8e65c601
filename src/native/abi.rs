//! Envoy's dynamic-module ABI `v0.2.0` (Envoy 1.40.0), the subset this shell uses: the C
//! types, the enums' values, and the callbacks Envoy exports. Every name is one the 1.40.0
//! binary exports. The end-to-end tests in real Envoy (the suite's native lane) exercise
//! every call but the certificate's attributes (a listener that serves only the fleet),
//! whose signatures rest on the ABI's header and the binary's disassembly: the
//! configuration's scheduler and callouts by the spend store's tests, `xds.cluster_name`,
//! `set_header` on a response and the response body's drain and append by the passthrough
//! tests. Envoy owns every buffer it hands over,
//! valid only during the hook it arrives in; a buffer the module passes is read during the
//! call only.

use std::ffi::c_void;

/// A buffer Envoy owns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub len: usize,
}

/// A buffer the module owns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub len: usize,
}

/// A header, Envoy's or the module's (one layout for both).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Header {
    pub key_ptr: *const u8,
    pub key_len: usize,
    pub value_ptr: *const u8,
    pub value_len: usize,
}

pub type EnvoyFilter = *mut c_void;
/// Envoy's side of a filter configuration (`http_filter_config_envoy_ptr`).
pub type EnvoyConfig = *mut c_void;
pub type Scheduler = *mut c_void;

/// `http_header_type`.
pub const REQUEST_HEADERS: i32 = 0;
pub const RESPONSE_HEADERS: i32 = 2;
/// `http_body_type`: the newest chunk, and what was buffered before it.
pub const RECEIVED_REQUEST_BODY: i32 = 0;
pub const BUFFERED_REQUEST_BODY: i32 = 1;
/// `http_body_type`: the newest chunk of the response.
pub const RECEIVED_RESPONSE_BODY: i32 = 2;
/// `log_level`.
pub const LOG_INFO: i32 = 2;
pub const LOG_WARN: i32 = 3;
pub const LOG_ERROR: i32 = 4;
pub const LOG_CRITICAL: i32 = 5;
/// Header and trailer hooks' statuses.
pub const CONTINUE: i32 = 0;
pub const STOP_ITERATION: i32 = 1;
/// Body hooks' statuses.
pub const STOP_AND_BUFFER: i32 = 1;
/// `http_callout_init_result` and `http_callout_result`: success.
pub const CALLOUT_OK: i32 = 0;
/// `http_callout_init_result`: the call names a cluster Envoy does not know.
pub const CALLOUT_CLUSTER_NOT_FOUND: i32 = 2;
/// `metrics_result`: success.
pub const METRICS_OK: i32 = 0;
/// `attribute_id`: whether the connection is mutual TLS, and the peer certificate's first
/// DNS and URI SANs.
pub const ATTRIBUTE_MTLS: i32 = 29;
pub const ATTRIBUTE_DNS_SAN: i32 = 35;
pub const ATTRIBUTE_URI_SAN: i32 = 37;
/// `attribute_id`: `xds.cluster_name`, the cluster the request's route leads to.
pub const ATTRIBUTE_XDS_CLUSTER_NAME: i32 = 57;

extern "C" {
    pub fn envoy_dynamic_module_callback_log(level: i32, message: ModuleBuffer);
    pub fn envoy_dynamic_module_callback_http_get_headers_size(filter: EnvoyFilter, kind: i32) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_headers(filter: EnvoyFilter, kind: i32, out: *mut Header) -> bool;
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter: EnvoyFilter,
        kind: i32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_body_size(filter: EnvoyFilter, kind: i32) -> usize;
    pub fn envoy_dynamic_module_callback_http_drain_body(filter: EnvoyFilter, kind: i32, bytes: usize) -> bool;
    pub fn envoy_dynamic_module_callback_http_append_body(filter: EnvoyFilter, kind: i32, data: ModuleBuffer) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(filter: EnvoyFilter, kind: i32) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: EnvoyFilter,
        kind: i32,
        out: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_received_buffered_request_body(filter: EnvoyFilter) -> bool;
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: EnvoyFilter,
        status: u32,
        headers: *const Header,
        headers_len: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    pub fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: EnvoyFilter,
        id_out: *mut u64,
        cluster: ModuleBuffer,
        headers: *const Header,
        headers_len: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_filter_start_http_stream(
        filter: EnvoyFilter,
        id_out: *mut u64,
        cluster: ModuleBuffer,
        headers: *const Header,
        headers_len: usize,
        body: ModuleBuffer,
        end_stream: bool,
        timeout_ms: u64,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_send_response_headers(
        filter: EnvoyFilter,
        headers: *const Header,
        headers_len: usize,
        end_stream: bool,
    );
    pub fn envoy_dynamic_module_callback_http_send_response_data(
        filter: EnvoyFilter,
        data: ModuleBuffer,
        end_stream: bool,
    );
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        id_out: *mut usize,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        id_out: *mut usize,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        id_out: *mut usize,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: EnvoyFilter,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_filter_set_gauge(
        filter: EnvoyFilter,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_filter_record_histogram_value(
        filter: EnvoyFilter,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
        filter: EnvoyFilter,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(filter: EnvoyFilter) -> Scheduler;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler: Scheduler, event: u64);
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: Scheduler);
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(config: EnvoyConfig) -> Scheduler;
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(scheduler: Scheduler, event: u64);
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: Scheduler);
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: EnvoyConfig,
        id_out: *mut u64,
        cluster: ModuleBuffer,
        headers: *const Header,
        headers_len: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: EnvoyConfig,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> i32;
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_bool(
        filter: EnvoyFilter,
        id: i32,
        out: *mut bool,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: EnvoyFilter,
        id: i32,
        out: *mut EnvoyBuffer,
    ) -> bool;
}

impl ModuleBuffer {
    pub fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer { ptr: bytes.as_ptr(), len: bytes.len() }
    }

    pub fn none() -> ModuleBuffer {
        ModuleBuffer { ptr: std::ptr::null(), len: 0 }
    }
}

impl EnvoyBuffer {
    /// Its bytes, copied (Envoy's are valid only during the hook).
    pub fn to_vec(self) -> Vec<u8> {
        // SAFETY: Envoy hands a pointer to `len` readable bytes, valid during this hook.
        if self.ptr.is_null() || self.len == 0 {
            return Vec::new();
        }
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

impl Header {
    pub fn of(name: &str, value: &str) -> Header {
        Header { key_ptr: name.as_ptr(), key_len: name.len(), value_ptr: value.as_ptr(), value_len: value.len() }
    }

    /// Its name and value, copied.
    pub fn pair(&self) -> (Vec<u8>, Vec<u8>) {
        let key = EnvoyBuffer { ptr: self.key_ptr, len: self.key_len };
        let value = EnvoyBuffer { ptr: self.value_ptr, len: self.value_len };
        (key.to_vec(), value.to_vec())
    }
}
