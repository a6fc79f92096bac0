//! The driver's initialization, devices and their primary contexts (made current around our
//! work and restored after), peer access and device memory totals.

use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;

use crate::{Error, check, cuda, driver_present};

/// Initializes the driver API (idempotent).
pub fn init() -> Result<(), Error> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    result::init().map_err(cuda("initializing the CUDA driver"))
}

/// Number of CUDA devices.
pub fn device_count() -> Result<i32, Error> {
    init()?;
    result::device::get_count().map_err(cuda("counting devices"))
}

/// Free and total bytes of device memory of the current context's device (`cuMemGetInfo`).
pub fn mem_info() -> Result<(u64, u64), Error> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: two valid out-pointers; the caller made a context current.
    let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
    check(r, "querying device memory")?;
    Ok((free as u64, total as u64))
}

/// A device and its primary context (the one PyTorch and the CUDA runtime use), retained for
/// the life of the process.
pub struct Device {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    sms: u32,
    uuid: [u8; 16],
    numa: Option<u32>,
    overlap: bool,
}

// SAFETY: CUdevice is an integer and CUcontext an opaque handle that the driver accepts from any
// thread; the primary context is never released (see Device::open).
unsafe impl Send for Device {}
// SAFETY: as above; all methods only pass the handles to the driver.
unsafe impl Sync for Device {}

impl Device {
    /// Opens device `ordinal` (cached: one `Device` per ordinal per process).
    pub fn open(ordinal: i32) -> Result<Arc<Device>, Error> {
        use std::collections::HashMap;
        use std::sync::Mutex;
        // Per process: a fork child neither takes its parent's devices nor waits for a lock a
        // parent's thread held at the fork.
        static DEVICES: crate::process::PerProcess<Mutex<HashMap<i32, Arc<Device>>>> =
            crate::process::PerProcess::fresh_in_children();
        init()?;
        let map = DEVICES.get(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let dev = result::device::get(ordinal).map_err(cuda("getting a device"))?;
        // SAFETY: `dev` is valid. The retain is never released: the primary context must outlive
        // kernels that may still run when a communicator is dropped.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(cuda("retaining the primary context"))?;
        // SAFETY: valid device and attribute.
        let sms = unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        }
        .map_err(cuda("querying the SM count"))?;
        let uuid = result::device::get_uuid(dev).map_err(cuda("querying the device UUID"))?;
        // Programmatic launches (launch_overlapped) need compute capability 9.0 and a CUDA 12
        // driver (cuLaunchKernelEx).
        // SAFETY: valid device and attribute.
        let major = unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
        }
        .unwrap_or(0);
        let mut driver = 0;
        // SAFETY: a valid out pointer.
        let driver_ok = unsafe { sys::cuDriverGetVersion(&mut driver) }
            .result()
            .is_ok();
        let overlap = major >= 9 && driver_ok && driver >= 12000;
        let numa = numa_node_of(dev);
        let d = Arc::new(Device {
            ordinal,
            dev,
            ctx,
            sms: sms.max(1) as u32,
            uuid: uuid.bytes.map(|b| b as u8),
            numa,
            overlap,
        });
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sms
    }

    /// Whether kernels on this device can be launched with [`launch_overlapped`](crate::launch_overlapped) (compute
    /// capability 9.0 or later, CUDA 12 driver).
    pub fn supports_overlapped_launch(&self) -> bool {
        self.overlap
    }

    /// The device UUID.
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// The NUMA node of the host memory nearest to the device (from the PCI device's
    /// `numa_node` in sysfs), `None` where the machine does not say.
    pub fn numa_node(&self) -> Option<u32> {
        self.numa
    }

    /// The primary context handle.
    pub fn context(&self) -> sys::CUcontext {
        self.ctx
    }

    /// Makes this device's primary context current on the calling thread until the guard drops
    /// (restoring whatever was current before; nothing is pushed when it already is current).
    pub fn activate(&self) -> Result<CtxGuard, Error> {
        let cur = result::ctx::get_current().map_err(cuda("reading the current context"))?;
        if cur == Some(self.ctx) {
            return Ok(CtxGuard { pushed: false });
        }
        // SAFETY: `self.ctx` is a retained primary context.
        let r = unsafe { sys::cuCtxPushCurrent_v2(self.ctx) };
        check(r, "making the context current")?;
        Ok(CtxGuard { pushed: true })
    }

    /// Whether this device can map memory of `other` (always true for itself).
    pub fn can_access_peer(&self, other: &Device) -> Result<bool, Error> {
        if other.dev == self.dev {
            return Ok(true);
        }
        let mut ok = 0;
        // SAFETY: out-pointer; both devices are valid.
        let r = unsafe { sys::cuDeviceCanAccessPeer(&mut ok, self.dev, other.dev) };
        check(r, "querying peer access")?;
        Ok(ok != 0)
    }

    /// Enables access from this device's context to `other`'s memory (in-process peers).
    pub fn enable_peer_access(&self, other: &Device) -> Result<(), Error> {
        if other.dev == self.dev {
            return Ok(());
        }
        let _g = self.activate()?;
        // SAFETY: both contexts are retained primary contexts; flags must be 0.
        let r = unsafe { sys::cuCtxEnablePeerAccess(other.ctx, 0) };
        if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check(r, "enabling peer access")
    }
}

/// The NUMA node sysfs gives for the PCI device of `dev` (`None`: unknown, or a machine of one
/// node, where sysfs says -1).
fn numa_node_of(dev: sys::CUdevice) -> Option<u32> {
    use sys::CUdevice_attribute as A;
    let attr = |a| {
        // SAFETY: valid device and attribute.
        unsafe { result::device::get_attribute(dev, a) }.ok()
    };
    let (domain, bus, device) = (
        attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
        attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
    );
    let path = format!("/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0/numa_node");
    std::fs::read_to_string(path)
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// Restores the previously current context on drop.
pub struct CtxGuard {
    pushed: bool,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops exactly the context this guard pushed.
            let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
        }
    }
}
